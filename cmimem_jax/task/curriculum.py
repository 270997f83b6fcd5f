"""Stratified curriculum (paper Eq. 14).

Each training session gets `d = w_s·t + w_c·|C_t| + w_q·|Q_t|` (t: session
index, |C_t|: candidate fragments — here the session's turn count, a proxy
known before any policy runs, |Q_t|: its QA pairs). Sessions are split
into tiers by difficulty percentile and sorted ascending within each tier;
every batch draws from every tier, consuming each tier in ascending order,
so difficulty rises within an epoch without abrupt jumps between steps.
The batch of step s is a pure function of s: resuming needs only s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class SessionRef:
  dialogue: int     # Index into the training dialogues.
  session: int      # Session index t within the dialogue.
  difficulty: float


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
               tiers: int = 3):
    if not sessions:
      raise ValueError("the curriculum needs at least one session")
    if tiers < 1 or batch_size < tiers:
      raise ValueError(f"need 1 <= tiers <= batch_size, got tiers={tiers}, "
                       f"batch_size={batch_size}")
    if len(sessions) < tiers:
      raise ValueError(f"{len(sessions)} sessions cannot fill {tiers} tiers")
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

  @property
  def steps_per_epoch(self) -> int:
    return -(-self.num_sessions // self.batch_size)

  def epoch(self, step: int) -> int:
    return step // self.steps_per_epoch

  def batch(self, step: int) -> list[SessionRef]:
    """The sessions of global step `step` (tiers cycle as they run out)."""
    out = []
    for tier, quota in zip(self.tiers, self.quota):
      start = step * quota
      out.extend(tier[(start + i) % len(tier)] for i in range(quota))
    return out
