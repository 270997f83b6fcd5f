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
      "api_key_env": ""})  # e.g. "CMIMEM_API_KEY" to require a key.
  return config
