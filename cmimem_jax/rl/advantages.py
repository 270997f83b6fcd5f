"""Group-relative advantages (SPEC §5, paper Eq. 13)."""

from __future__ import annotations

import numpy as np


def group_advantages(rewards: np.ndarray, valid: np.ndarray, group_size: int,
                     eps: float = 1e-6) -> np.ndarray:
  """`A_i = (r_i·valid_i − mean_g) / (std_g + eps)` within each group.

  Computed on whole groups, before any micro-batching: rows `g·N … g·N+N−1`
  of the flat batch are the N rollouts of prompt g. The standard deviation
  is the unbiased one (as verl's GRPO); a group of one rollout, or one whose
  gated rewards are all equal, gets advantage 0 (never NaN).

  Args:
    rewards: `[G·N]` composite rewards.
    valid: `[G·N]` validity gate (malformed rollouts count as reward 0).
    group_size: N.

  Returns:
    `[G·N]` float32 advantages.
  """
  rewards = np.asarray(rewards, np.float64)
  if rewards.ndim != 1 or rewards.size % group_size:
    raise ValueError(f"rewards must be flat with a multiple of group_size="
                     f"{group_size} entries, got shape {rewards.shape}")
  if not np.all(np.isfinite(rewards)):
    raise ValueError("rewards contain NaN or inf at rows "
                     f"{np.flatnonzero(~np.isfinite(rewards)).tolist()}")
  gated = (rewards * np.asarray(valid, bool)).reshape(-1, group_size)
  mean = gated.mean(axis=1, keepdims=True)
  if group_size == 1:
    return np.zeros(rewards.shape, np.float32)
  std = gated.std(axis=1, ddof=1, keepdims=True)
  advantages = (gated - mean) / (std + eps)
  advantages[np.broadcast_to(std, gated.shape) == 0] = 0.0
  return advantages.reshape(-1).astype(np.float32)
