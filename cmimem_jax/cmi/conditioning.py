"""Local conditioning sets (paper App. F; SPEC §4.2) for a batch of operations.

For an operation on a bank `M_{t-1}` the retrieval query is

    q = w_C·e_C + w_new·e_new + w_old·e_old        (Eq. 17; e_old for updates)

and the conditioning set is the top-k (8) entries by cosine to `q` plus the
`n_recent` (2) most recent episodic entries, deduplicated, padded to a fixed
`N = k + n_recent` with a validity mask so one compiled kernel serves every
operation of a batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import ClassVar

import jax
import jax.numpy as jnp

from cmimem_jax.config import Section, need


@dataclasses.dataclass(frozen=True)
class ConditioningConfig(Section):
  """App. F / Table 7 knobs. Other published counts (15 recent + 5 similar,
  3 + 5) are reachable by changing `top_k` and `n_recent`."""
  top_k: int = 8
  n_recent: int = 2
  w_context: float = 0.5
  w_new: float = 0.5
  w_old: float = 0.3

  SECTION: ClassVar[str] = "reward.conditioning"

  def invalid(self) -> Iterator[str]:
    yield from need(self, "top_k", lambda v: v >= 1, ">= 1")
    yield from need(self, "n_recent", lambda v: v >= 0, ">= 0")

  @property
  def size(self) -> int:
    return self.top_k + self.n_recent


def conditioning_sets(scores_context: jax.Array, scores_new: jax.Array,
                      scores_old: jax.Array, has_old: jax.Array,
                      entry_valid: jax.Array, recent: jax.Array,
                      config: ConditioningConfig
                      ) -> tuple[jax.Array, jax.Array]:
  """Indices and mask of each operation's conditioning set.

  Args:
    scores_context: `[Bk, M]` cosines of each bank's entries to `e_C`.
    scores_new: `[Bk, O, M]` cosines to each operation's `e_new`.
    scores_old: `[Bk, O, M]` cosines to `e_old` (ignored where not has_old).
    has_old: `[Bk, O]` bool, True for REPLACE/UPDATE operations.
    entry_valid: `[Bk, M]` bool, real (non-padding) entries.
    recent: `[Bk, R]` int positions of the most recent episodic entries,
      newest first, -1 where absent (R >= config.n_recent).
    config: Set sizes and query weights.

  Returns:
    `(index [Bk, O, N], mask [Bk, O, N])` with `N = top_k + n_recent`;
    masked slots (padding, duplicates, missing entries) point at entry 0.
  """
  query_scores = (config.w_context * scores_context[:, None, :]
                  + config.w_new * scores_new
                  + config.w_old * has_old[..., None] * scores_old)
  query_scores = jnp.where(entry_valid[:, None, :], query_scores, -jnp.inf)
  k = min(config.top_k, query_scores.shape[-1])
  top_scores, top_index = jax.lax.top_k(query_scores, k)  # [Bk, O, k]
  top_mask = jnp.isfinite(top_scores)
  recent = recent[:, :config.n_recent]
  recent_index = jnp.broadcast_to(recent[:, None, :],
                                  top_index.shape[:2] + recent.shape[-1:])
  in_top = jnp.any((recent_index[..., :, None] == top_index[..., None, :])
                   & top_mask[..., None, :], axis=-1)
  recent_mask = (recent_index >= 0) & ~in_top
  index = jnp.concatenate([top_index, jnp.maximum(recent_index, 0)], axis=-1)
  mask = jnp.concatenate([top_mask, recent_mask], axis=-1)
  pad = config.size - index.shape[-1]  # Banks smaller than top_k.
  if pad > 0:
    index = jnp.pad(index, [(0, 0), (0, 0), (0, pad)])
    mask = jnp.pad(mask, [(0, 0), (0, 0), (0, pad)])
  return jnp.where(mask, index, 0), mask
