"""QA contexts (Alg. 2) and answer models.

A context provider turns a question into the Listing-10 answer prompt and
the plain context text (what `context_recall` searches). `MemoryContext`
answers from a memory bank: top-k fragments over all entry types + the
core block + the fragments' source turns (`LookupChunk`) + the question
date. `TurnRAG` is the utterance-level retrieval baseline (Table 5).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import faiss
import numpy as np

from cmimem_jax.data.types import Dialogue, Question
from cmimem_jax.encoders.base import Encoder
from cmimem_jax.client import CallResult, ChatModel, submit_chats, then
from cmimem_jax.memory.bank import MemoryBank, embed_texts
from cmimem_jax.memory.prompt_builder import build_answer_prompt
from cmimem_jax.memory.retrieval import (DEFAULT_CHUNK_BUDGET_CHARS, Chunk,
                                         lookup_chunks)

if TYPE_CHECKING:  # The judges module is beside this one.
  from cmimem_jax.evaluation.judges import LLMJudge


@dataclasses.dataclass(frozen=True)
class QAContext:
  prompt: str               # Listing 10, ready for the answer model.
  context: str              # Everything retrieved, as text.
  retrieved: tuple[str, ...]  # Ids of what was retrieved, in rank order.
  turns: tuple[str, ...]      # Dialogue turns shown in the context.


class ContextProvider(Protocol):
  def __call__(self, question: Question) -> QAContext:
    ...

  def many(self, questions: Sequence[Question]) -> list[QAContext]:
    ...


class MemoryContext:
  """Alg. 2 over one user's bank."""

  def __init__(self, bank: MemoryBank, dialogue: Dialogue, encoder: Encoder,
               top_k: int = 10,
               chunk_budget_chars: int = DEFAULT_CHUNK_BUDGET_CHARS):
    self.bank, self.dialogue, self.encoder = bank, dialogue, encoder
    self.top_k, self.chunk_budget_chars = top_k, chunk_budget_chars

  def __call__(self, question: Question) -> QAContext:
    return self.many([question])[0]

  def many(self, questions: Sequence[Question]) -> list[QAContext]:
    """Contexts for several questions (one encoder call for all)."""
    queries = embed_texts(self.encoder, [q.question for q in questions],
                          kind="query")
    return [self._context(q, self.bank.search(v, self.top_k))
            for q, v in zip(questions, queries)]

  def _context(self, question: Question, hits) -> QAContext:
    chunks = lookup_chunks(hits, self.dialogue, self.chunk_budget_chars)
    prompt = build_answer_prompt(question.question, self.bank, hits, chunks,
                                 question.question_date,
                                 sessions=self.dialogue.sessions)
    context = "\n".join([self.bank.core] + [h.entry.text for h in hits]
                        + [c.format() for c in chunks])
    return QAContext(prompt, context, tuple(h.entry.entry_id for h in hits),
                     tuple(t.turn_id for c in chunks for t in c.turns))


class TurnRAG:
  """Utterance-level FAISS retrieval: each turn is a document."""

  def __init__(self, dialogue: Dialogue, encoder: Encoder, top_k: int = 10):
    self.dialogue, self.encoder, self.top_k = dialogue, encoder, top_k
    self.turns = [(s, t) for s in dialogue.sessions for t in s.turns]
    texts = [f"{t.speaker}: {t.text}" for _, t in self.turns]
    vectors = embed_texts(encoder, texts, kind="document") if texts else (
        np.zeros((0, encoder.dim), np.float32))
    self.index = faiss.IndexFlatIP(encoder.dim)
    if len(vectors):
      self.index.add(np.ascontiguousarray(vectors, np.float32))

  def __call__(self, question: Question) -> QAContext:
    return self.many([question])[0]

  def many(self, questions: Sequence[Question]) -> list[QAContext]:
    """Contexts for several questions (one encoder call for all)."""
    k = min(self.top_k, len(self.turns))
    if not k:
      return [self._context(q, []) for q in questions]
    queries = embed_texts(self.encoder, [q.question for q in questions],
                          kind="query")
    _, ids = self.index.search(np.ascontiguousarray(queries, np.float32), k)
    return [self._context(q, [int(i) for i in row if i >= 0])
            for q, row in zip(questions, ids)]

  def _context(self, question: Question, order: list[int]) -> QAContext:
    # Group the hits by session, in dialogue order (as LookupChunk does).
    by_session: dict[int, list[int]] = {}
    for i in sorted(order):
      by_session.setdefault(self.turns[i][0].index, []).append(i)
    chunks = [Chunk(self.turns[ids[0]][0],
                    tuple(self.turns[i][1] for i in ids))
              for _, ids in sorted(by_session.items())]
    prompt = build_answer_prompt(question.question,
                                 MemoryBank(self.dialogue.dialogue_id,
                                            self.encoder.dim),
                                 [], chunks, question.question_date)
    ranked = tuple(self.turns[i][1].turn_id for i in order)
    return QAContext(prompt, "\n".join(c.format() for c in chunks), ranked,
                     ranked)


def submit_answers(model: ChatModel, contexts: Sequence[QAContext]
                   ) -> list[concurrent.futures.Future[CallResult]]:
  """Asks the answer model every prompt (one user message each) without
  waiting (`client.submit_chats`)."""
  return submit_chats(model, [[{"role": "user", "content": c.prompt}]
                              for c in contexts])


@dataclasses.dataclass(frozen=True)
class JudgedAnswer:
  """One question's answer call and, when it answered and there is a
  judge, the judge's `(score or None, error or raw verdict)`."""
  answer: CallResult
  verdict: tuple[float | None, str] | None


def answer_and_judge(answerer: ChatModel, judge: LLMJudge | None,
                     questions: Sequence[Question],
                     contexts: Sequence[QAContext]
                     ) -> list[concurrent.futures.Future[JudgedAnswer]]:
  """Every question's answer call sent at once, and each answer's judge
  call as soon as that answer arrives (not after the others); returns at
  once, one future per question, in order. Failed answers are not judged.
  """
  def judged(question: Question, answer: CallResult):
    if judge is None or not answer.ok:
      return JudgedAnswer(answer, None)
    return then(judge.submit(question, answer.text),
                lambda verdict: JudgedAnswer(answer, verdict))
  return [then(answer, functools.partial(judged, question))
          for question, answer in zip(questions,
                                      submit_answers(answerer, contexts))]
