"""Training batches: sampler rollouts (GRPO) and prompt/response pairs
(supervised warm start), both as left-padded prompt + right-padded
completion rows."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cmimem_jax.sampling.constraint import TokenConstraint
from cmimem_jax.sampling.sampler import SampleOutput, left_pad


def shared_prompt_group(tokens: np.ndarray, mask: np.ndarray, start: int,
                        groups_divisor: int = 1) -> int:
  """Rows per shared prompt: the largest G such that every run of G
  consecutive rows has the same tokens and mask before column `start` (the
  G rollouts of one prompt, as `ChatPolicy.generate` lays them out) and the
  B / G prompts split into `groups_divisor` equal parts (micro-batches x
  data shards). 1 when no rows share a prompt.

  Args:
    tokens, mask: `[B, T]` host arrays of a training batch.
    start: the first completion column.
  """
  rows = tokens.shape[0]
  prompts = np.concatenate([tokens[:, :start], mask[:, :start]], axis=1)
  # Where a row's prompt differs from the previous row's, a run ends.
  changes = np.flatnonzero(np.any(prompts[1:] != prompts[:-1], axis=1)) + 1
  runs = np.diff(np.concatenate([[0], changes, [rows]]))
  shared = int(np.gcd.reduce(runs))
  # Every divisor of `shared` splits every run, and so the rows, evenly.
  return next((g for g in range(shared, 1, -1)
               if shared % g == 0 and (rows // g) % groups_divisor == 0), 1)


def rollout_batch(rollouts: SampleOutput, advantages: np.ndarray,
                  token_weights: np.ndarray | None = None,
                  constraint: TokenConstraint | None = None
                  ) -> dict[str, np.ndarray]:
  """Prompt (left-padded) + completion (right-padded) rows for the trainer.

  Args:
    rollouts: sampler output for B rows (prompt layout included).
    advantages: `[B]`.
    token_weights: `[B, R]` weights of the completion tokens (default 1).
    constraint: the sampler's grammar constraint, if any: adds the
      automaton state and token budget before every completion token
      (`constraint_states` / `constraint_budgets`, `[B, P + R]`, -1 and 0
      on the prompt), from which the learner rebuilds the sampler's mask.

  Returns:
    `GRPOLossConfig.batch_keys` arrays, `[B, P + R]` (advantages `[B]`); old
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
  batch = {
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
  if constraint is not None:
    prompt_none = np.full(rollouts.prompt_tokens.shape, -1, np.int32)
    batch["constraint_states"] = np.concatenate(
        [prompt_none, constraint.states(rollouts.tokens, rollouts.lengths)], 1)
    budgets = np.broadcast_to(r - np.arange(r, dtype=np.int32), (b, r))
    batch["constraint_budgets"] = np.concatenate(
        [np.zeros_like(prompt_none), budgets], 1)
  return batch


def supervised_batch(prompts: Sequence[Sequence[int]],
                     responses: Sequence[Sequence[int]], prompt_length: int,
                     response_length: int, pad_id: int
                     ) -> dict[str, np.ndarray]:
  """Teacher-forced rows for `SFTLossConfig`: the loss covers the response
  tokens only (its EOS included when the caller appends one).

  Args:
    prompts / responses: token ids per row.
    prompt_length / response_length: padded widths (fixed, so one compiled
      step serves every batch).

  Returns:
    `SFTLossConfig.batch_keys` arrays, `[B, prompt_length + response_length]`.
  """
  if len(prompts) != len(responses):
    raise ValueError(f"{len(prompts)} prompts for {len(responses)} responses")
  too_long = [i for i, r in enumerate(responses) if len(r) > response_length]
  if too_long:
    raise ValueError(f"responses {too_long} exceed {response_length} tokens")
  prompt_tokens, prompt_mask = left_pad(prompts, prompt_length, pad_id)
  tokens = np.full((len(responses), response_length), pad_id, np.int32)
  completion = np.zeros((len(responses), response_length), np.int32)
  for row, response in enumerate(responses):
    tokens[row, :len(response)] = response
    completion[row, :len(response)] = 1
  zeros = np.zeros_like(prompt_mask)
  return {
      "tokens": np.concatenate([prompt_tokens, tokens], 1),
      "mask": np.concatenate([prompt_mask, completion], 1),
      "loss_mask": np.concatenate([zeros, completion], 1),
      "token_weights": np.concatenate([zeros, completion], 1
                                      ).astype(np.float32),
  }
