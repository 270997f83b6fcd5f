"""Stratified curriculum (paper Eq. 14).

Each training session gets `d = w_s·t + w_c·|C_t| + w_q·|Q_t|` (t: session
index, |C_t|: its candidate memory fragments — `candidate_fragments`,
known before any policy runs, |Q_t|: its QA pairs). Sessions are split
into tiers by difficulty percentile and sorted ascending within each tier.

An epoch is one pass over every session, as MemBuilder's verl run makes
5 passes over its sorted data: each pass walks every tier again in
ascending order, the tiers interleaved (the session of rank r in a tier
of n_i comes at fractional position (r + ½) / n_i), so every batch draws
from every tier and difficulty rises within each pass. The passes form
one stream cut into batches of `batch_size` (a batch may straddle two
passes), so no session is left out or doubled in a pass, and a session
never appears in two consecutive batches when there are at least twice
as many sessions as a batch holds (with fewer, no order can avoid it).
The batch of step s is a pure function of s: resuming needs only s, and
`rl.max_steps` cuts the plan without changing it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

# Re-exported: Eq. 14's |C_t| is part of the curriculum's API.
from cmimem_jax.data.fragments import candidate_fragments  # noqa: F401


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
  """Batches of `batch_size` sessions drawn from `tiers` difficulty tiers,
  `epochs` passes over every session."""

  def __init__(self, sessions: Sequence[SessionRef], batch_size: int,
               tiers: int = 3, epochs: int = 1):
    if not sessions:
      raise ValueError("the curriculum needs at least one session")
    if tiers < 1 or batch_size < tiers:
      raise ValueError(f"need 1 <= tiers <= batch_size, got tiers={tiers}, "
                       f"batch_size={batch_size}")
    if len(sessions) < tiers:
      raise ValueError(f"{len(sessions)} sessions cannot fill {tiers} tiers")
    if len(sessions) < batch_size:
      raise ValueError(f"{len(sessions)} sessions cannot fill a batch of "
                       f"{batch_size} distinct sessions")
    if epochs < 1:
      raise ValueError(f"the curriculum plans >= 1 epoch, got {epochs}")
    ordered = sorted(sessions, key=lambda s: (s.difficulty, s.dialogue,
                                              s.session))
    # Percentile split of the sorted list: tier sizes differ by at most 1.
    self.tiers = [list(t) for t in np.array_split(np.array(
        ordered, dtype=object), tiers)]
    # One pass: every tier ascending, interleaved by fractional rank.
    self.order = [s for _, _, s in sorted(
        ((rank + 0.5) / len(tier), i, session)
        for i, tier in enumerate(self.tiers)
        for rank, session in enumerate(tier))]
    self.batch_size = batch_size
    self.num_sessions = len(ordered)
    self.epochs = epochs

  @property
  def steps_per_epoch(self) -> float:
    """Batches per pass (fractional when a batch straddles two passes)."""
    return self.num_sessions / self.batch_size

  def epoch(self, step: int) -> int:
    """The pass the first session of step `step`'s batch belongs to."""
    return step * self.batch_size // self.num_sessions

  @property
  def planned_steps(self) -> int:
    """Steps that make `epochs` whole passes (the last batch may run into
    a further pass)."""
    return -(-self.epochs * self.num_sessions // self.batch_size)

  def batch(self, step: int) -> list[SessionRef]:
    """The sessions of global step `step`: stream positions
    `step·B .. step·B + B - 1` of the passes laid end to end."""
    first = step * self.batch_size
    return [self.order[(first + j) % self.num_sessions]
            for j in range(self.batch_size)]
