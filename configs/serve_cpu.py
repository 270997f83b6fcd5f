"""`python -m cmimem_jax.serve --config=configs/serve_cpu.py --port=8000`:
the embedded SmolLM2-135M-Instruct policy and all-MiniLM-L6-v2 encoder
behind an OpenAI-compatible API on 127.0.0.1 (a local answer model / judge
for `cmimem_jax.evaluate`, and the endpoint of `encoder.kind=openai`)."""

import ml_collections

from configs import tiny


def get_config() -> ml_collections.ConfigDict:
  config = tiny.get_config()
  config.policy.update({"source": "gguf", "path": "", "tokenizer": ""})
  config.encoder.update({"kind": "minilm", "dim": 384})
  config.serve = ml_collections.ConfigDict({
      "chat": True, "embeddings": True, "model_name": "cmimem-local",
      "max_batch": 8, "batch_wait_ms": 10.0, "max_new_tokens": 512,
      "max_prompt_tokens": 4096, "buckets": (256, 512, 1024, 2048, 4096),
      # e.g. "CMIMEM_API_KEY" to require that variable's (non-empty) value.
      "api_key_env": "",
      # Limits: larger bodies get 413, slower bodies 408, more chat requests
      # in flight 429; connections over the cap 503; connections with no
      # request in progress are closed after idle_timeout_s.
      "max_request_bytes": 1 << 20, "body_timeout_s": 10.0,
      "max_pending": 256, "max_connections": 1024, "idle_timeout_s": 5,
      # /v1/embeddings: more inputs get 413, longer inputs 400.
      "max_embedding_inputs": 256, "max_embedding_chars": 32_768,
      # After SIGTERM / Ctrl-C, requests in flight get this long.
      "shutdown_timeout_s": 3.0,
      # Compile every batch size for these prompt lengths' buckets before
      # serving (/health answers 503 until then): such a request never
      # waits on a compile. A prompt in another bucket (e.g. under 256
      # tokens) compiles its program on first use, with a warning. Prompt
      # buckets of evaluation's Listing 10 answers and Listing 11
      # judgements on LoCoMo.
      "warm_up_prompt_tokens": (512, 1024, 2048)})
  return config
