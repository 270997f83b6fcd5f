"""`r_QA` (SPEC §4.5): how well the session's QA pairs are answered from
the bank a rollout produced."""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
from collections.abc import Iterator, Sequence
from typing import ClassVar, Protocol

import numpy as np

from cmimem_jax.client import ChatModel, EndpointConfig, OpenAIClient
from cmimem_jax.config import (Section, Sections, finite_number, need,
                               positive_int)
from cmimem_jax.data.types import Dialogue, Question
from cmimem_jax.encoders.base import Encoder
from cmimem_jax.evaluation.answering import (JudgedAnswer, MemoryContext,
                                             answer_and_judge)
from cmimem_jax.evaluation.judges import LLMJudge, context_recall
from cmimem_jax.memory.bank import MemoryBank
from cmimem_jax.memory.builder import MemoryConfig
from cmimem_jax.memory.retrieval import DEFAULT_CHUNK_BUDGET_CHARS
from cmimem_jax.memory.types import MemoryType

class QASession(Protocol):
  """What `r_QA` reads of a session's episode (`task.episode.Episode`):
  its dialogue (the source turns) and its QA pairs."""

  @property
  def dialogue(self) -> Dialogue: ...

  @property
  def questions(self) -> tuple[Question, ...]: ...


QAResult = tuple[float, dict[MemoryType, int]]


class PendingQA:
  """A rollout's `r_QA` whose answer and judge calls are in flight:
  `wait` returns `(r_QA, retrievals per type)` (the failures counted on
  the first `wait`)."""

  def __init__(self, reward: QAReward, counts: dict[MemoryType, int],
               scores: Sequence[float | None] = (),
               calls: Sequence[concurrent.futures.Future[JudgedAnswer]] = ()):
    self._reward, self._counts = reward, counts
    self._scores, self._calls = list(scores), list(calls)

  def wait(self) -> QAResult:
    if self._calls:
      outcomes = [f.result() for f in self._calls]
      answered = [o for o in outcomes if o.answer.ok]
      self._scores = [o.verdict[0] for o in answered
                      if o.verdict[0] is not None]
      self._reward.failures["answer"] += len(outcomes) - len(answered)
      self._reward.failures["judge"] += len(answered) - len(self._scores)
      self._calls = []
    scores = self._scores
    return (float(np.mean(scores)) if scores else 0.0), self._counts


QA_JUDGES = ("context_recall", "llm")


@dataclasses.dataclass(frozen=True)
class QAConfig(Section):
  """The training job's `qa` section: how `r_QA` judges a rollout's
  memory (`QAReward`)."""

  SECTION: ClassVar[str] = "qa"

  judge: str                     # One of QA_JUDGES.
  top_k: int                     # Retrieved fragments per question.
  prompt: str                    # The LLM judge's prompt (`LLMJudge`).
  answer: EndpointConfig         # The answer model (judge="llm").
  judge_endpoint: EndpointConfig
  max_failure_rate: float        # Unjudged questions a step accepts.

  def invalid(self) -> Iterator[str]:
    yield from need(self, "judge", lambda v: v in QA_JUDGES,
                    "context_recall or llm")
    yield from need(self, "top_k", positive_int, "a positive integer")
    yield from need(self, "max_failure_rate",
                    lambda v: finite_number(v, 0.0, 1.0), "in [0, 1]")

  def invalid_with(self, sections: Sections) -> Iterator[str]:
    memory = sections.get(MemoryConfig)
    for key in ("compressor", "merge_summarizer"):
      if memory is not None and getattr(memory, key) == "answer" and (
          self.judge != "llm"):
        yield (f"memory.{key}='answer' needs qa.judge='llm' (the answer "
               "model is its endpoint)")


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
  def from_config(cls, qa: QAConfig, memory: MemoryConfig,
                  encoder: Encoder) -> QAReward:
    """The training job's `r_QA` (`qa` and `memory` sections): the judge,
    top-k, and the LookupChunk budget (0 under `memory.source_chunks =
    False`, the RM ablation)."""
    answerer = judge = None
    if qa.judge == "llm":
      answerer = OpenAIClient(qa.answer)
      judge = LLMJudge(OpenAIClient(qa.judge_endpoint), qa.prompt)
    return cls(encoder, qa.judge, qa.top_k, memory.qa_chunk_budget,
               answerer, judge)

  def __call__(self, bank: MemoryBank, episode: QASession) -> QAResult:
    return self.submit(bank, episode).wait()

  def submit(self, bank: MemoryBank, episode: QASession) -> PendingQA:
    """Retrieves every question's context now and sends its answer call
    (each judged as soon as it is answered, `answer_and_judge`); the
    calls run in the endpoints' pools while the caller goes on."""
    if not episode.questions:
      return PendingQA(self, {})
    provider = MemoryContext(bank, episode.dialogue, self.encoder, self.top_k,
                             self.chunk_budget_chars)
    contexts = provider.many(episode.questions)
    types = {e.entry_id: e.memory_type for e in bank.entries()}
    counts = dict(collections.Counter(types[i] for c in contexts
                                      for i in c.retrieved if i in types))
    if self.kind == "context_recall":
      return PendingQA(self, counts, [
          score for q, c in zip(episode.questions, contexts)
          if (score := context_recall(q, c.context)) is not None])
    return PendingQA(self, counts, calls=answer_and_judge(
        self.answerer, self.judge, episode.questions, contexts))
