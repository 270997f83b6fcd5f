"""Evaluation on this CPU: utterance RAG (or a built memory) + the offline
`context_recall` judge, on the LoCoMo file; no network needed.

  python -m cmimem_jax.evaluate --config=configs/eval_cpu.py --workdir=DIR
  ... --config.dataset.name=longmemeval \
      --config.dataset.path=../shared/data/longmemeval/longmemeval_oracle_2q_sample.json
  ... --config.method=rag --config.rag_top_k=5 --config.limit=100
  ... --config.judge.kind=llm --config.answer.kind=endpoint \
      --config.answer.endpoint.base_url=http://127.0.0.1:8000/v1 \
      --config.answer.endpoint.model=NAME --config.judge.endpoint.model=NAME
"""

import ml_collections

from cmimem_jax.config import memory_defaults


def endpoint_defaults() -> ml_collections.ConfigDict:
  """An OpenAI-compatible endpoint (`client.EndpointConfig`), with limits
  that fit our own server on 2 CPU cores (`configs/serve_cpu.py`): as many
  calls in flight as it batches (8), answers of up to 128 tokens (a
  Listing 10 answer or Listing 11 verdict is far shorter), 300 s for a
  batch of long prompts. Raise them for a hosted model."""
  return ml_collections.ConfigDict({
      "base_url": "http://127.0.0.1:8000/v1", "model": "",
      "api_key_env": "OPENAI_API_KEY", "timeout_s": 300.0, "max_retries": 3,
      "backoff_s": 1.0, "max_backoff_s": 30.0, "concurrency": 8,
      "temperature": 0.0, "max_tokens": 128})


def model_section(kind: str) -> ml_collections.ConfigDict:
  """A chat model: "endpoint", our Flax policy ("local": `path` a GGUF file
  or an HF checkpoint folder, empty = the embedded SmolLM2-135M-Instruct;
  `init_checkpoint` a `train` / `sft` workdir whose weights of step
  `checkpoint_step` (0: the newest) replace the loaded ones), or "none". `constrained_dsl`: a local builder of the
  `policy` method decodes valid DSL only."""
  return ml_collections.ConfigDict({
      "kind": kind, "endpoint": endpoint_defaults(), "path": "",
      "init_checkpoint": "", "checkpoint_step": 0, "max_new_tokens": 256,
      "constrained_dsl": False})


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.dataset = ml_collections.ConfigDict({
      "name": "locomo", "path": "../shared/data/locomo/locomo10.json",
      # Dialogues start .. start + dialogues - 1 (dialogues 0: to the end).
      "start": 0, "dialogues": 0,
      # "": LongMemEval's 400-question test split, any other file whole;
      # or all | sft | rl | test.
      "split": ""})
  config.encoder = ml_collections.ConfigDict(
      {"kind": "minilm", "dim": 384, "path": ""})
  config.memory = memory_defaults()
  config.method = "rag"      # rag | prompting | policy
  config.rag_top_k = 10      # Table 5: top-5 and top-10.
  config.limit = 0           # First N questions (0: all).
  config.judge = ml_collections.ConfigDict({
      "kind": "context_recall",  # context_recall | llm
      "prompt": "listing11",     # listing11 | longmemeval
      "endpoint": endpoint_defaults()})
  config.answer = model_section("none")        # Who answers (llm judge).
  config.builder = model_section("endpoint")   # Who builds memories.
  return config
