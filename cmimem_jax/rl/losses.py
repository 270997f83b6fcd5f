"""The learner's objectives as pure functions of per-token arrays: GRPO
(paper Eq. 13) and the supervised warm start (token-mean NLL of the
response). Their config classes are the `TrainStepConfig.loss` of one
shared train step: each names the batch arrays it reads and whether it
needs the frozen reference model.

Every statistic is returned as a *sum over tokens* divided by the global
token count supplied by the caller, so summing the outputs of k
micro-batches gives exactly the full-batch value (token-mean over the
global batch, SPEC §5).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

Batch = dict[str, jax.Array]
Stats = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class GRPOLossConfig:
  """Clipped surrogate + k3 KL over sampled completions (rollout batches,
  `rl.rollout_batch`)."""
  epsilon_low: float = 0.2   # ratio floor 1 - epsilon_low (A < 0 side).
  epsilon_high: float = 0.2  # ratio ceiling 1 + epsilon_high (A > 0 side).
  kl_beta: float = 0.02      # 0 skips the reference model entirely.

  # `[B, T]` arrays, `advantages` `[B]`.
  batch_keys: ClassVar[tuple[str, ...]] = (
      "tokens", "mask", "loss_mask", "old_logprobs", "advantages",
      "token_weights")

  def __post_init__(self):
    if not 0 <= self.epsilon_low < 1 or self.epsilon_high < 0:
      raise ValueError("need 0 <= epsilon_low < 1 and epsilon_high >= 0")
    if self.kl_beta < 0:
      raise ValueError("kl_beta must be >= 0")

  @property
  def uses_reference(self) -> bool:
    return self.kl_beta > 0

  def __call__(self, logprobs: jax.Array, entropy: jax.Array, batch: Batch,
               num_tokens: jax.Array, ref_logprobs: jax.Array | None = None
               ) -> tuple[jax.Array, Stats]:
    return grpo_loss(logprobs, batch["old_logprobs"], batch["advantages"],
                     batch["loss_mask"], batch["token_weights"], num_tokens,
                     self, ref_logprobs=ref_logprobs, entropy=entropy)


@dataclasses.dataclass(frozen=True)
class SFTLossConfig:
  """Negative log-likelihood of the response tokens (teacher trajectories,
  `rl.supervised_batch`), token-mean over the global batch."""

  batch_keys: ClassVar[tuple[str, ...]] = (
      "tokens", "mask", "loss_mask", "token_weights")
  uses_reference: ClassVar[bool] = False

  def __call__(self, logprobs: jax.Array, entropy: jax.Array, batch: Batch,
               num_tokens: jax.Array, ref_logprobs: jax.Array | None = None
               ) -> tuple[jax.Array, Stats]:
    del ref_logprobs
    return sft_loss(logprobs, batch["loss_mask"], batch["token_weights"],
                    num_tokens, entropy=entropy)


# What `TrainStepConfig.loss` may be.
Objective = GRPOLossConfig | SFTLossConfig


def _token_mean(loss_mask: jax.Array, num_tokens: jax.Array):
  """Sum over masked tokens / the global token count."""
  mask = loss_mask.astype(jnp.float32)
  denom = jnp.maximum(num_tokens.astype(jnp.float32), 1.0)
  # `where`, not `x * mask`: padding may hold values that overflow (inf*0).
  return mask, lambda x: jnp.sum(jnp.where(mask > 0, x, 0.0)) / denom


def k3_kl(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
  """Schulman's k3 estimator of KL(π‖π_ref) per token: e^{Δ} − Δ − 1 with
  Δ = log π_ref − log π (non-negative, unbiased)."""
  delta = ref_logprobs - logprobs
  return jnp.exp(delta) - delta - 1.0


def grpo_loss(logprobs: jax.Array, old_logprobs: jax.Array,
              advantages: jax.Array, loss_mask: jax.Array,
              token_weights: jax.Array, num_tokens: jax.Array,
              config: GRPOLossConfig,
              ref_logprobs: jax.Array | None = None,
              entropy: jax.Array | None = None
              ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Clipped surrogate + k3 KL, token-mean over the global batch.

  Args:
    logprobs: `[B, T]` current policy log-probs (differentiated).
    old_logprobs: `[B, T]` log-probs of the policy that sampled.
    advantages: `[B]` group advantages.
    loss_mask: `[B, T]` 1 on completion tokens.
    token_weights: `[B, T]` per-token loss weights (attribution).
    num_tokens: completion tokens in the *global* batch (scalar).
    config: clip range and KL weight.
    ref_logprobs: `[B, T]` frozen reference log-probs (needed if β > 0).
    entropy: `[B, T]` optional, only reported.

  Returns:
    `(loss, stats)`: stats are token sums / num_tokens (exact when summed
    over micro-batches).
  """
  mask, mean = _token_mean(loss_mask, num_tokens)
  adv = advantages[:, None].astype(jnp.float32)
  log_ratio = logprobs - jax.lax.stop_gradient(old_logprobs)
  # Masked-out positions may hold arbitrary values: keep exp() finite.
  ratio = jnp.exp(jnp.where(mask > 0, log_ratio, 0.0))
  clipped = jnp.clip(ratio, 1.0 - config.epsilon_low, 1.0 + config.epsilon_high)
  surrogate = jnp.minimum(ratio * adv, clipped * adv)
  # Attribution weights (App. D Eq. 16) scale the policy-gradient term
  # only; the KL regulariser stays unweighted.
  objective = surrogate * token_weights
  stats = {}
  if config.kl_beta > 0:
    if ref_logprobs is None:
      raise ValueError("kl_beta > 0 needs ref_logprobs")
    kl = k3_kl(logprobs, jax.lax.stop_gradient(ref_logprobs))
    objective = objective - config.kl_beta * kl
    stats["kl"] = mean(kl)
  loss = -mean(objective)
  stats.update(
      loss=loss,
      clip_low_frac=mean(((ratio < 1.0 - config.epsilon_low) & (adv < 0))
                         .astype(jnp.float32)),
      clip_high_frac=mean(((ratio > 1.0 + config.epsilon_high) & (adv > 0))
                          .astype(jnp.float32)),
      ratio_mean=mean(ratio),
      logprob_gap=mean(jnp.abs(jax.lax.stop_gradient(log_ratio))))
  if entropy is not None:
    stats["entropy"] = mean(jax.lax.stop_gradient(entropy))
  return loss, stats


def sft_loss(logprobs: jax.Array, loss_mask: jax.Array,
             token_weights: jax.Array, num_tokens: jax.Array,
             entropy: jax.Array | None = None
             ) -> tuple[jax.Array, Stats]:
  """Weighted NLL of the response tokens, token-mean over the global batch.

  Args:
    logprobs: `[B, T]` log-probs of the target tokens (differentiated).
    loss_mask: `[B, T]` 1 on response tokens.
    token_weights: `[B, T]` per-token loss weights.
    num_tokens: response tokens in the *global* batch (scalar).
    entropy: `[B, T]` optional, only reported.

  Returns:
    `(loss, stats)` as `grpo_loss`'s (sums / num_tokens).
  """
  _, mean = _token_mean(loss_mask, num_tokens)
  loss = -mean(logprobs * token_weights)
  stats = {"loss": loss, "nll": mean(-jax.lax.stop_gradient(logprobs))}
  if entropy is not None:
    stats["entropy"] = mean(jax.lax.stop_gradient(entropy))
  return loss, stats
