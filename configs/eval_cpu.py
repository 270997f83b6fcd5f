"""Evaluation on this CPU: the paper's evaluation (`configs/paper.py`) with
utterance RAG (or a built memory) and the offline `context_recall` judge,
all-MiniLM-L6-v2 retrieval, on the LoCoMo file; no network needed.

  python -m cmimem_jax.evaluate --config=configs/eval_cpu.py --workdir=DIR
  ... --config.dataset.name=longmemeval \\
      --config.dataset.path=../shared/data/longmemeval/longmemeval_oracle_2q_sample.json
  ... --config.method=rag --config.rag_top_k=5 --config.limit=100
  ... --config.judge.kind=llm --config.answer.kind=endpoint \\
      --config.answer.endpoint.base_url=http://127.0.0.1:8000/v1 \\
      --config.answer.endpoint.model=NAME --config.judge.endpoint.model=NAME
"""

import ml_collections

from cmimem_jax.config import memory_defaults
from configs import paper


def get_config() -> ml_collections.ConfigDict:
  config = paper.evaluation()
  config.dataset.update({"name": "locomo",
                         "path": "../shared/data/locomo/locomo10.json",
                         "split": ""})
  config.encoder = ml_collections.ConfigDict(
      {"kind": "minilm", "dim": 384, "path": ""})
  # No model compresses the core or summarises merges on the CPU.
  config.memory = memory_defaults()
  config.method = "rag"
  config.judge.update({"kind": "context_recall",
                       "endpoint": paper.evaluation_endpoint()})
  config.answer = paper.model_section("none")
  config.builder = paper.model_section("endpoint")
  return config
