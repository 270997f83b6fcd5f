"""CMI-Mem episodes: one training session `C_t` with its memory state
`M_{t-1}` — the policy prompt, applying a response to a copy of the state,
scoring a group of rollouts (CMI terms + QA reward), and attribution token
weights (Alg. 1, SPEC §4.4, §5)."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from cmimem_jax.client import Messages
from cmimem_jax.cmi.reward import (RewardComputer, RewardTerms, RolloutInput,
                                   token_weights)
from cmimem_jax.data.types import Dialogue, Question, Session
from cmimem_jax.encoders.base import Encoder
from cmimem_jax.memory.apply import MemoryEditors, apply_response
from cmimem_jax.memory.bank import MemoryBank
from cmimem_jax.memory.builder import core_config, count_model_edits
from cmimem_jax.memory.dsl import ParsedResponse, parse
from cmimem_jax.memory.prompt_builder import build_policy_messages
from cmimem_jax.memory.retrieval import retrieve_per_type
from cmimem_jax.task.qa_reward import QAReward


@dataclasses.dataclass(frozen=True)
class Episode:
  dialogue: Dialogue
  session: Session
  bank: MemoryBank                  # M_{t-1}.
  questions: tuple[Question, ...]   # The session's QA pairs.
  # The expert's response for the session (fixed expert states): the
  # length penalty's reference; None = none known.
  expert: ParsedResponse | None = None


def session_questions(dialogue: Dialogue, session: Session
                      ) -> tuple[Question, ...]:
  """The per-session QA pairs (`session_qa`) whose evidence is `session`."""
  return tuple(q for q in dialogue.questions
               if q.evidence_sessions == (session.session_id,))


# Whether a policy prompt fits a token budget (`fitted_policy_messages`).
PromptFits = Callable[[Messages], bool]


def fitted_policy_messages(bank: MemoryBank, session: Session,
                           encoder: Encoder, top_k: int,
                           fits: PromptFits | None = None
                           ) -> tuple[Messages, int]:
  """`policy_messages`; with `fits`, a prompt it rejects shows fewer
  retrieved entries per type (each type's least similar dropped first)
  until it fits or none are left.

  Returns:
    The messages and the retrieved entries per type they show.
  """
  retrieved = (retrieve_per_type(bank, encoder, session.format(), top_k)
               if top_k > 0 and len(bank) else {})
  k = top_k
  messages = build_policy_messages(bank, session, retrieved)
  while fits is not None and k > 0 and not fits(messages):
    k -= 1
    messages = build_policy_messages(
        bank, session, {t: hits[:k] for t, hits in retrieved.items()})
  return messages, k


def policy_messages(bank: MemoryBank, session: Session, encoder: Encoder,
                    top_k: int) -> Messages:
  """Listings 6-7 with the top-k entries per type (k = 0: no retrieval
  index, the ablation)."""
  return fitted_policy_messages(bank, session, encoder, top_k)[0]


def apply_to_copy(bank: MemoryBank, session: Session, response: ParsedResponse,
                  encoder: Encoder, memory: Any,
                  editors: MemoryEditors = MemoryEditors(),
                  stats: collections.Counter[str] | None = None
                  ) -> MemoryBank:
  """`M_t` = Apply(M_{t-1}, response); the input bank is never mutated.
  What the model rewrites did is added to `stats`."""
  bank, report = apply_response(
      bank, response, encoder, session_index=session.index,
      turn_ids=tuple(t.turn_id for t in session.turns),
      core_config=core_config(memory), editors=editors,
      update_match_threshold=memory.update_match_threshold)
  if stats is not None:
    count_model_edits(stats, report)
  return bank


def score_rollouts(episodes: Sequence[Episode], texts: Sequence[str],
                   group_size: int, encoder: Encoder, memory: Any,
                   qa: QAReward, computer: RewardComputer,
                   editors: MemoryEditors = MemoryEditors(),
                   stats: collections.Counter[str] | None = None
                   ) -> tuple[list[ParsedResponse], list[RewardTerms]]:
  """Parses, applies and scores `group_size` responses per episode (row
  `e·N + i` is rollout i of episode e); the CMI terms of the whole batch
  go through the kernel in one call. Core compressions and MERGE
  summaries are counted in `stats`."""
  if len(texts) != len(episodes) * group_size:
    raise ValueError(f"{len(texts)} responses for {len(episodes)} episodes "
                     f"x {group_size}")
  parsed, rollouts = [], []
  for row, text in enumerate(texts):
    episode = episodes[row // group_size]
    response = parse(text)
    qa_reward, counts, after = 0.0, None, None
    if response.valid:
      after = apply_to_copy(episode.bank, episode.session, response, encoder,
                            memory, editors, stats)
      qa_reward, counts = qa(after, episode)
    parsed.append(response)
    rollouts.append(RolloutInput(episode.bank, episode.session.format(),
                                 response, qa_reward, counts, after,
                                 episode.session.user_turns(),
                                 episode.expert))
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
