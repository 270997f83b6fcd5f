"""`r_QA` (SPEC §4.5): how well the session's QA pairs are answered from
the bank a rollout produced."""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any

import numpy as np

from cmimem_jax.client import ChatModel, EndpointConfig, OpenAIClient
from cmimem_jax.config import qa_chunk_budget
from cmimem_jax.encoders.base import Encoder
from cmimem_jax.evaluation.answering import MemoryContext
from cmimem_jax.evaluation.judges import LLMJudge, context_recall
from cmimem_jax.memory.bank import MemoryBank
from cmimem_jax.memory.retrieval import DEFAULT_CHUNK_BUDGET_CHARS
from cmimem_jax.memory.types import MemoryType

if TYPE_CHECKING:  # The episode module imports this one.
  from cmimem_jax.task.episode import Episode


class QAReward:
  """`r_QA`: fraction of the session's QA pairs answered from `M_t`
  (Alg. 2 contexts), with `context_recall` or an LLM answer + judge; also
  how often each memory type was retrieved (for attribution).

  Failed judgements are left out of the fraction and counted in
  `failures`; a rollout with no judged question gets `r_QA = 0`.
  """

  def __init__(self, encoder: Encoder, kind: str, top_k: int = 10,
               chunk_budget_chars: int = DEFAULT_CHUNK_BUDGET_CHARS,
               answerer: ChatModel | None = None,
               judge: LLMJudge | None = None):
    if kind not in ("context_recall", "llm"):
      raise ValueError(f"unknown QA judge {kind!r}")
    if kind == "llm" and (answerer is None or judge is None):
      raise ValueError("the llm QA judge needs an answer model and a judge")
    self.encoder, self.kind, self.top_k = encoder, kind, top_k
    self.chunk_budget_chars = chunk_budget_chars
    self.answerer, self.judge = answerer, judge
    self.failures: collections.Counter[str] = collections.Counter()

  @classmethod
  def from_config(cls, config: Any, encoder: Encoder) -> QAReward:
    """The training job's `r_QA` (`qa` and `memory` sections): the judge,
    top-k, and the LookupChunk budget (0 under `memory.source_chunks =
    False`, the RM ablation)."""
    answerer = judge = None
    if config.qa.judge == "llm":
      answerer = OpenAIClient(EndpointConfig.from_config(config.qa.answer))
      judge = LLMJudge(OpenAIClient(EndpointConfig.from_config(
          config.qa.judge_endpoint)), config.qa.prompt)
    return cls(encoder, config.qa.judge, config.qa.top_k,
               qa_chunk_budget(config.memory), answerer, judge)

  def __call__(self, bank: MemoryBank, episode: Episode
               ) -> tuple[float, dict[MemoryType, int]]:
    if not episode.questions:
      return 0.0, {}
    provider = MemoryContext(bank, episode.dialogue, self.encoder, self.top_k,
                             self.chunk_budget_chars)
    contexts = provider.many(episode.questions)
    types = {e.entry_id: e.memory_type for e in bank.entries()}
    counts = collections.Counter(types[i] for c in contexts
                                 for i in c.retrieved if i in types)
    if self.kind == "context_recall":
      scores = [score for q, c in zip(episode.questions, contexts)
                if (score := context_recall(q, c.context)) is not None]
    else:
      answers = self.answerer.chat_many(
          [[{"role": "user", "content": c.prompt}] for c in contexts])
      answered = [(q, a.text) for q, a in zip(episode.questions, answers)
                  if a.ok]
      self.failures["answer"] += len(contexts) - len(answered)
      verdicts = self.judge.judge_many([q for q, _ in answered],
                                       [a for _, a in answered])
      scores = [s for s, _ in verdicts if s is not None]
      self.failures["judge"] += len(verdicts) - len(scores)
    return (float(np.mean(scores)) if scores else 0.0), dict(counts)
