"""CMI-Mem episodes: one training session `C_t` with its memory state
`M_{t-1}` — prompts, snapshots, QA reward and rollout scoring (Alg. 1,
SPEC §4.4-4.5, §5)."""

from __future__ import annotations

import collections
import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from cmimem_jax.cmi.reward import (RewardComputer, RewardTerms, RolloutInput,
                                   token_weights)
from cmimem_jax.data.types import Dialogue, Question, Session
from cmimem_jax.encoders.base import Encoder
from cmimem_jax.evaluation.answering import ChatModel, MemoryContext
from cmimem_jax.evaluation.judges import LLMJudge, context_recall
from cmimem_jax.memory.apply import apply_response
from cmimem_jax.memory.bank import MemoryBank
from cmimem_jax.memory.builder import core_config
from cmimem_jax.memory.dsl import ParsedResponse, parse
from cmimem_jax.memory.prompt_builder import build_policy_messages
from cmimem_jax.memory.retrieval import retrieve_per_type
from cmimem_jax.memory.types import MemoryType

Messages = list[dict[str, str]]


@dataclasses.dataclass(frozen=True)
class Episode:
  dialogue: Dialogue
  session: Session
  bank: MemoryBank                  # M_{t-1}.
  questions: tuple[Question, ...]   # The session's QA pairs.


def session_questions(dialogue: Dialogue, session: Session
                      ) -> tuple[Question, ...]:
  """The per-session QA pairs (`session_qa`) whose evidence is `session`."""
  return tuple(q for q in dialogue.questions
               if q.evidence_sessions == (session.session_id,))


def policy_messages(bank: MemoryBank, session: Session, encoder: Encoder,
                    top_k: int) -> Messages:
  """Listings 6-7 with the top-k entries per type (k = 0: no retrieval
  index, the ablation)."""
  retrieved = (retrieve_per_type(bank, encoder, session.format(), top_k)
               if top_k > 0 and len(bank) else {})
  return build_policy_messages(bank, session, retrieved)


def apply_to_copy(bank: MemoryBank, session: Session, response: ParsedResponse,
                  encoder: Encoder, memory: Any) -> MemoryBank:
  """`M_t` = Apply(M_{t-1}, response); the input bank is never mutated."""
  bank, _ = apply_response(
      bank, response, encoder, session_index=session.index,
      turn_ids=tuple(t.turn_id for t in session.turns),
      core_config=core_config(memory),
      update_match_threshold=memory.update_match_threshold)
  return bank


class QAReward:
  """`r_QA`: fraction of the session's QA pairs answered from `M_t`
  (Alg. 2 contexts), with `context_recall` or an LLM answer + judge; also
  how often each memory type was retrieved (for attribution).

  Failed judgements are left out of the fraction and counted in
  `failures`; a rollout with no judged question gets `r_QA = 0`.
  """

  def __init__(self, encoder: Encoder, kind: str, top_k: int = 10,
               chunk_budget_chars: int = 8000,
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
      scores = [context_recall(q, c.context)
                for q, c in zip(episode.questions, contexts)]
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


def score_rollouts(episodes: Sequence[Episode], texts: Sequence[str],
                   group_size: int, encoder: Encoder, memory: Any,
                   qa: QAReward, computer: RewardComputer
                   ) -> tuple[list[ParsedResponse], list[RewardTerms]]:
  """Parses, applies and scores `group_size` responses per episode (row
  `e·N + i` is rollout i of episode e); the CMI terms of the whole batch
  go through the kernel in one call."""
  if len(texts) != len(episodes) * group_size:
    raise ValueError(f"{len(texts)} responses for {len(episodes)} episodes "
                     f"x {group_size}")
  parsed, rollouts = [], []
  for row, text in enumerate(texts):
    episode = episodes[row // group_size]
    response = parse(text)
    qa_reward, counts = 0.0, None
    if response.valid:
      after = apply_to_copy(episode.bank, episode.session, response, encoder,
                            memory)
      qa_reward, counts = qa(after, episode)
    parsed.append(response)
    rollouts.append(RolloutInput(episode.bank, episode.session.format(),
                                 response, qa_reward, counts))
  return parsed, computer(rollouts)


def token_char_offsets(decode: Callable[[list[int]], str],
                       tokens: Sequence[int]) -> list[tuple[int, int]]:
  """Character span of each token in `decode(tokens)` (prefix decoding,
  so multi-byte pieces get the span where their text appears)."""
  spans, previous = [], 0
  for t in range(len(tokens)):
    end = len(decode(list(tokens[:t + 1])))
    spans.append((previous, max(previous, end)))
    previous = max(previous, end)
  return spans


def attribution_weights(terms: RewardTerms, decode: Callable[[list[int]], str],
                        tokens: Sequence[int], width: int) -> np.ndarray:
  """`[width]` loss weights of a completion's tokens (1 past its end)."""
  weights = np.ones(width, np.float32)
  if tokens:
    weights[:len(tokens)] = token_weights(
        token_char_offsets(decode, tokens), terms.line_weights)
  return weights


def build_snapshots(dialogues: Sequence[Dialogue],
                    respond: Callable[[list[Messages]], list[str]],
                    encoder: Encoder, memory: Any, top_k: int
                    ) -> list[list[MemoryBank]]:
  """`M_{t-1}` for every session of every dialogue, built by running the
  policy (greedy) through the dialogues; session t of all dialogues is one
  batched `respond` call.

  Returns:
    `banks[d][t]`: the bank before session t of dialogue d.
  """
  banks = [[MemoryBank(d.dialogue_id, encoder.dim)] for d in dialogues]
  longest = max(len(d.sessions) for d in dialogues)
  for t in range(longest - 1):  # The last session's successor is unused.
    active = [i for i, d in enumerate(dialogues) if t + 1 < len(d.sessions)]
    messages = [policy_messages(banks[i][t], dialogues[i].sessions[t],
                                encoder, top_k) for i in active]
    for i, text in zip(active, respond(messages)):
      session = dialogues[i].sessions[t]
      banks[i].append(apply_to_copy(banks[i][t], session, parse(text),
                                    encoder, memory))
  return banks


def save_snapshots(directory: str, banks: list[list[MemoryBank]]) -> None:
  for per_dialogue in banks:
    for t, bank in enumerate(per_dialogue):
      bank.save(os.path.join(directory, bank.user_id, f"s{t}"))


def load_snapshots(directory: str, dialogues: Sequence[Dialogue]
                   ) -> list[list[MemoryBank]] | None:
  """The cached snapshots, or None if any is missing."""
  banks = []
  for dialogue in dialogues:
    per_dialogue = []
    for t in range(len(dialogue.sessions)):
      path = os.path.join(directory, dialogue.dialogue_id, f"s{t}")
      if not os.path.exists(os.path.join(path, "CURRENT")):
        return None
      per_dialogue.append(MemoryBank.load(path))
    banks.append(per_dialogue)
  return banks
