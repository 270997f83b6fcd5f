"""Training batches from sampler rollouts."""

from __future__ import annotations

import numpy as np

from cmimem_jax.sampling.sampler import SampleOutput


def rollout_batch(rollouts: SampleOutput, advantages: np.ndarray,
                  token_weights: np.ndarray | None = None
                  ) -> dict[str, np.ndarray]:
  """Prompt (left-padded) + completion (right-padded) rows for the trainer.

  Args:
    rollouts: sampler output for B rows (prompt layout included).
    advantages: `[B]`.
    token_weights: `[B, R]` weights of the completion tokens (default 1).

  Returns:
    The `BATCH_KEYS` arrays, `[B, P + R]` (advantages `[B]`); old
    log-probs are the sampler's.
  """
  b, r = rollouts.tokens.shape
  completion = (np.arange(r)[None] < rollouts.lengths[:, None]).astype(np.int32)
  if token_weights is None:
    token_weights = np.ones((b, r), np.float32)
  if token_weights.shape != (b, r):
    raise ValueError(f"token_weights must be {(b, r)}, got "
                     f"{token_weights.shape}")
  prompt_zeros = np.zeros(rollouts.prompt_tokens.shape, np.float32)
  return {
      "tokens": np.concatenate([rollouts.prompt_tokens, rollouts.tokens], 1),
      "mask": np.concatenate([rollouts.prompt_mask, completion], 1),
      "loss_mask": np.concatenate([prompt_zeros.astype(np.int32), completion],
                                  1),
      "old_logprobs": np.concatenate(
          [prompt_zeros, rollouts.logprobs * completion], 1),
      "advantages": np.asarray(advantages, np.float32),
      "token_weights": np.concatenate(
          [prompt_zeros, np.asarray(token_weights, np.float32) * completion],
          1),
  }
