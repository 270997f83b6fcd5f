"""Stratified curriculum (paper Eq. 14).

Each training session gets `d = w_s·t + w_c·|C_t| + w_q·|Q_t|` (t: session
index, |C_t|: its candidate memory fragments — `candidate_fragments`,
known before any policy runs, |Q_t|: its QA pairs). Sessions are split
into tiers by difficulty percentile and sorted ascending within each tier;
every batch draws from every tier.

Difficulty rises across the whole run, not per epoch (§3.4: "the overall
training difficulty increases progressively across epochs"): over the
planned `epochs × steps_per_epoch` steps each tier is walked once in
ascending order, every session taking its `epochs` visits on consecutive
steps (as PPO epochs reuse a batch), so no step falls back to easier
sessions. The batch of step s is a pure function of s and the plan:
resuming needs only s, and `rl.max_steps` cuts the plan without changing it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class SessionRef:
  dialogue: int     # Index into the training dialogues.
  session: int      # Session index t within the dialogue.
  difficulty: float


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")
# Fewer words carry no fact worth a memory ("ok", "thanks a lot!").
MIN_FRAGMENT_WORDS = 4


def candidate_fragments(turn_texts: Sequence[str]) -> int:
  """|C_t| of Eq. 14: the session's sentences of at least
  `MIN_FRAGMENT_WORDS` words, each a candidate memory fragment."""
  return sum(len(sentence.split()) >= MIN_FRAGMENT_WORDS
             for text in turn_texts for sentence in _SENTENCE_END.split(text))


def difficulty(session_index: int, num_candidates: int, num_questions: int,
               weights: Sequence[float] = (1.0, 1.0, 1.0)) -> float:
  """Eq. 14 with `weights = (w_s, w_c, w_q)`, all >= 0."""
  w_s, w_c, w_q = weights
  if min(weights) < 0:
    raise ValueError(f"curriculum weights must be >= 0, got {weights}")
  return w_s * session_index + w_c * num_candidates + w_q * num_questions


class Curriculum:
  """Batches of `batch_size` sessions drawn from `tiers` difficulty tiers."""

  def __init__(self, sessions: Sequence[SessionRef], batch_size: int,
               tiers: int = 3, epochs: int = 1):
    if not sessions:
      raise ValueError("the curriculum needs at least one session")
    if tiers < 1 or batch_size < tiers:
      raise ValueError(f"need 1 <= tiers <= batch_size, got tiers={tiers}, "
                       f"batch_size={batch_size}")
    if len(sessions) < tiers:
      raise ValueError(f"{len(sessions)} sessions cannot fill {tiers} tiers")
    if epochs < 1:
      raise ValueError(f"the curriculum plans >= 1 epoch, got {epochs}")
    ordered = sorted(sessions, key=lambda s: (s.difficulty, s.dialogue,
                                              s.session))
    # Percentile split of the sorted list: tier sizes differ by at most 1.
    self.tiers = [list(t) for t in np.array_split(np.array(
        ordered, dtype=object), tiers)]
    self.batch_size = batch_size
    # Each batch takes quota[i] sessions from tier i (sum = batch_size).
    base, extra = divmod(batch_size, tiers)
    self.quota = [base + (i < extra) for i in range(tiers)]
    self.num_sessions = len(ordered)
    self.epochs = epochs

  @property
  def steps_per_epoch(self) -> int:
    return -(-self.num_sessions // self.batch_size)

  def epoch(self, step: int) -> int:
    return step // self.steps_per_epoch

  @property
  def planned_steps(self) -> int:
    return self.epochs * self.steps_per_epoch

  def batch(self, step: int) -> list[SessionRef]:
    """The sessions of global step `step`.

    Pick j of tier i at step s is the session of rank
    `(j·T + s)·n_i / (q_i·T)` (T planned steps, n_i sessions, q_i picks per
    step): the q_i picks come from disjoint ascending segments of the tier
    (never a session twice in one batch while n_i >= q_i), each segment
    walked once over the plan. Steps past the plan start it again.
    """
    plan = self.planned_steps
    position = step % plan
    out = []
    for tier, quota in zip(self.tiers, self.quota):
      span = quota * plan
      out.extend(tier[(j * plan + position) * len(tier) // span]
                 for j in range(quota))
    return out
