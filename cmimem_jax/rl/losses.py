"""The learner's objectives as pure functions of per-token arrays: GRPO
(paper Eq. 13) and the supervised warm start (token-mean NLL of the
response). Their config classes are the `TrainStepConfig.loss` of one
shared train step: each names the batch arrays it reads and whether it
needs the frozen reference model.

Every statistic is a sum over tokens weighted by `token_scale`, the
per-token share of the *global* batch (`aggregation_scale`, computed by the
caller before micro-batching), so summing the outputs of k micro-batches
gives exactly the full-batch value. Two aggregations (SPEC §5):
"token_mean" (every completion token of the global batch weighs the same:
verl's default, which MemBuilder's run uses) and "sequence_mean" (each
sequence's tokens averaged, then the sequences: the GRPO paper's Eq.).

The GRPO objective is verl's actor loss term by term (`core_algos`:
`compute_policy_loss` with dual-clip, `kl_penalty` "low_var_kl",
`agg_loss`; tests/rl/test_parity.py checks it against verl 0.4.0, the
version MemBuilder's launch script runs on, and 0.4.1, the first with the
log-ratio clamp), and TRL's GRPO loss with dual-clip and clamps off.

Old log-probs (`GRPOLossConfig.old_logprobs`): "learner" takes them as
verl's on-policy path does with one update per step (MemBuilder's run:
the actor recomputes them with the weights it is about to update), but
inside the train step, from the same forward as the differentiated
log-probs under `stop_gradient`: the ratio is exactly 1 on every token,
its gradient is ∇log π, clipping and dual-clip never bind, and no extra
forward is spent. The micro-batches of one step all see the start-of-step
weights (gradients accumulate, then one update), so every micro-batch's
stopped log-probs are the start-of-step policy's. The sampler's decode-time
log-probs stay in the batch as the train/inference mismatch, logged as
verl logs it (`rollout_probs_diff_*`). "sampler" takes the sampler's as
old: what several updates per step (PPO epochs) need, where the policy
moves away from the one that sampled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import ClassVar

import jax
import jax.numpy as jnp

from cmimem_jax.config import Section, need

Batch = dict[str, jax.Array]
Stats = dict[str, jax.Array]

AGGREGATIONS = ("token_mean", "sequence_mean")
OLD_LOGPROBS = ("learner", "sampler")
# Statistics whose micro-batch values combine by maximum, not by sum.
MAX_SUFFIX = "_max"


def aggregation_scale(loss_mask: jax.Array, aggregation: str) -> jax.Array:
  """`[B, T]` weight of each loss token in the global batch's mean (sums to
  1 over the tokens of `loss_mask` `[B, T]`; 0 elsewhere).

  "token_mean": 1 / (tokens in the batch); "sequence_mean": 1 / (tokens in
  the row · rows with any token).
  """
  mask = loss_mask.astype(jnp.float32)
  if aggregation == "token_mean":
    return mask / jnp.maximum(jnp.sum(mask), 1.0)
  if aggregation == "sequence_mean":
    lengths = jnp.sum(mask, axis=1, keepdims=True)
    rows = jnp.maximum(jnp.sum(lengths > 0), 1).astype(jnp.float32)
    return mask / (jnp.maximum(lengths, 1.0) * rows)
  raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got "
                   f"{aggregation!r}")


@dataclasses.dataclass(frozen=True)
class GRPOLossConfig(Section):
  """Clipped surrogate + k3 KL over sampled completions (rollout batches,
  `rl.rollout_batch`)."""
  epsilon_low: float = 0.2   # ratio floor 1 - epsilon_low (A < 0 side).
  epsilon_high: float = 0.2  # ratio ceiling 1 + epsilon_high (A > 0 side).
  kl_beta: float = 0.02      # 0 skips the reference model entirely.
  aggregation: str = "token_mean"  # One of AGGREGATIONS.
  # Dual-clip PPO (Ye et al. 2020, verl's `clip_ratio_c`): where A < 0 the
  # per-token objective is at least clip_ratio_c · A, so a far off-policy
  # token (ratio > clip_ratio_c) stops pushing. 0 turns it off; else > 1.
  clip_ratio_c: float = 3.0
  # |log π − log π_old| and |log π_ref − log π| are clamped to this before
  # exp() (verl >= 0.4.1's numerics guard: no inf ratio, so no 0 · inf NaN
  # at A = 0 or in the KL's gradient). 0 turns it off.
  log_ratio_clamp: float = 20.0
  # The k3 KL per token is clamped to [−kl_clamp, kl_clamp] (verl's
  # "low_var_kl"; every verl version). 0 turns it off (TRL's k3).
  kl_clamp: float = 10.0
  # Whose log-probs are π_old (module docstring): "learner" (the policy's
  # own at the start of the step, under stop_gradient: ratio ≡ 1, verl's
  # on-policy path; one update per step) or "sampler" (the batch's
  # `old_logprobs`, the decode-time ones).
  old_logprobs: str = "sampler"

  # `[B, T]` arrays, `advantages` `[B]`; `old_logprobs` are the sampler's
  # (π_old under "sampler", the mismatch metric's reference under
  # "learner").
  batch_keys: ClassVar[tuple[str, ...]] = (
      "tokens", "mask", "loss_mask", "old_logprobs", "advantages",
      "token_weights")

  def invalid(self) -> Iterator[str]:
    """The objective's rules, one for every caller (`rl` config section
    and code alike): a ratio floor 1 - epsilon_low in (0, 1]; any
    ceiling 1 + epsilon_high >= 1 (DAPO's clip-higher raises it)."""
    yield from need(self, "epsilon_low", lambda v: 0 <= v < 1, "in [0, 1)")
    yield from need(self, "epsilon_high", lambda v: v >= 0, ">= 0")
    # NaN fails too.
    yield from need(self, "kl_beta", lambda v: v >= 0, ">= 0")
    yield from need(self, "clip_ratio_c", lambda v: v == 0 or v > 1,
                    "0 (no dual-clip) or > 1")
    for name in ("log_ratio_clamp", "kl_clamp"):
      yield from need(self, name, lambda v: v >= 0, ">= 0 (0: off)")
    yield from need(self, "aggregation", lambda v: v in AGGREGATIONS,
                    f"one of {AGGREGATIONS}")
    yield from need(self, "old_logprobs", lambda v: v in OLD_LOGPROBS,
                    f"one of {OLD_LOGPROBS} ('learner': the policy's own, "
                    "ratio 1; 'sampler': the decode-time ones)")

  @property
  def uses_reference(self) -> bool:
    return self.kl_beta > 0

  def __call__(self, logprobs: jax.Array, entropy: jax.Array, batch: Batch,
               ref_logprobs: jax.Array | None = None
               ) -> tuple[jax.Array, Stats]:
    sampler = batch["old_logprobs"]
    old = (jax.lax.stop_gradient(logprobs) if self.old_logprobs == "learner"
           else sampler)
    return grpo_loss(logprobs, old, batch["advantages"],
                     batch["token_scale"], batch["token_weights"], self,
                     ref_logprobs=ref_logprobs, entropy=entropy,
                     sampler_logprobs=sampler)


@dataclasses.dataclass(frozen=True)
class SFTLossConfig:
  """Negative log-likelihood of the response tokens (teacher trajectories,
  `rl.supervised_batch`), token-mean over the global batch."""

  batch_keys: ClassVar[tuple[str, ...]] = (
      "tokens", "mask", "loss_mask", "token_weights")
  uses_reference: ClassVar[bool] = False
  aggregation: ClassVar[str] = "token_mean"

  def __call__(self, logprobs: jax.Array, entropy: jax.Array, batch: Batch,
               ref_logprobs: jax.Array | None = None
               ) -> tuple[jax.Array, Stats]:
    del ref_logprobs
    return sft_loss(logprobs, batch["token_scale"], batch["token_weights"],
                    entropy=entropy)


# What `TrainStepConfig.loss` may be.
Objective = GRPOLossConfig | SFTLossConfig


def _weighted_mean(token_scale: jax.Array):
  """The batch mean under `token_scale` (`aggregation_scale`), and the loss
  mask it implies."""
  mask = (token_scale > 0).astype(jnp.float32)
  # `where`, not `x * scale`: padding may hold values that overflow (inf*0).
  return mask, lambda x: jnp.sum(jnp.where(mask > 0, x * token_scale, 0.0))


def _masked_max(x: jax.Array, mask: jax.Array) -> jax.Array:
  """Largest value of `x` >= 0 over the tokens of `mask` (0 for none)."""
  return jnp.max(jnp.where(mask > 0, x, 0.0), initial=0.0)


def combine_stats(total: Stats, part: Stats) -> Stats:
  """Statistics of two micro-batches combined: sums, except `*_max`
  statistics (maxima)."""
  return {name: (jnp.maximum if name.endswith(MAX_SUFFIX) else jnp.add)(
      total[name], part[name]) for name in total}


def _clamp(x: jax.Array, bound: float) -> jax.Array:
  """`x` clipped to [−bound, bound]; unchanged for bound 0 (off)."""
  return jnp.clip(x, -bound, bound) if bound else x


def k3_kl(logprobs: jax.Array, ref_logprobs: jax.Array,
          log_ratio_clamp: float = 0.0, kl_clamp: float = 0.0) -> jax.Array:
  """Schulman's k3 estimator of KL(π‖π_ref) per token: e^{Δ} − Δ − 1 with
  Δ = log π_ref − log π (non-negative, unbiased); verl's "low_var_kl"
  with Δ clamped to ±`log_ratio_clamp` and the result to ±`kl_clamp`
  (0: no clamp). Shapes: any, alike."""
  delta = _clamp(ref_logprobs - logprobs, log_ratio_clamp)
  return _clamp(jnp.exp(delta) - delta - 1.0, kl_clamp)


def grpo_token_terms(logprobs: jax.Array, old_logprobs: jax.Array,
                     advantages: jax.Array, mask: jax.Array,
                     config: GRPOLossConfig,
                     ref_logprobs: jax.Array | None = None
                     ) -> dict[str, jax.Array]:
  """The per-token terms of the GRPO objective, before weights and means.

  Args:
    logprobs: `[B, T]` current policy log-probs (differentiated).
    old_logprobs: `[B, T]` log-probs of the policy that sampled.
    advantages: `[B]` group advantages.
    mask: `[B, T]` loss tokens (> 0); off it every log-prob reads 0, so
      padding may hold anything.
    config: clip range, dual-clip, clamps.
    ref_logprobs: `[B, T]` frozen reference log-probs, or None (no "kl").

  Returns:
    `[B, T]` arrays: "ratio" π/π_old (after the log-ratio clamp),
    "surrogate" (the clipped, dual-clipped objective; verl's −pg_losses),
    "log_ratio" (unclamped, stopped) and, with `ref_logprobs`, "kl" (k3).
  """
  # Masked-out positions may hold arbitrary values: garbage must not reach
  # exp() (its gradient is multiplied by 0 there, and 0 · inf is NaN).
  on = lambda x: jnp.where(mask > 0, x, 0.0)
  adv = advantages[:, None].astype(jnp.float32)
  log_ratio = on(logprobs) - on(jax.lax.stop_gradient(old_logprobs))
  ratio = jnp.exp(_clamp(log_ratio, config.log_ratio_clamp))
  clipped = jnp.clip(ratio, 1.0 - config.epsilon_low, 1.0 + config.epsilon_high)
  surrogate = jnp.minimum(ratio * adv, clipped * adv)
  if config.clip_ratio_c:
    surrogate = jnp.where(adv < 0, jnp.maximum(surrogate,
                                               config.clip_ratio_c * adv),
                          surrogate)
  terms = {"ratio": ratio, "surrogate": surrogate,
           "log_ratio": jax.lax.stop_gradient(log_ratio)}
  if ref_logprobs is not None:
    terms["kl"] = k3_kl(on(logprobs), on(jax.lax.stop_gradient(ref_logprobs)),
                        config.log_ratio_clamp, config.kl_clamp)
  return terms


def grpo_loss(logprobs: jax.Array, old_logprobs: jax.Array,
              advantages: jax.Array, token_scale: jax.Array,
              token_weights: jax.Array, config: GRPOLossConfig,
              ref_logprobs: jax.Array | None = None,
              entropy: jax.Array | None = None,
              sampler_logprobs: jax.Array | None = None
              ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Clipped surrogate + k3 KL, averaged over the global batch.

  Args:
    logprobs: `[B, T]` current policy log-probs (differentiated).
    old_logprobs: `[B, T]` π_old: the sampler's, or `logprobs` under
      stop_gradient (on-policy, ratio ≡ 1).
    advantages: `[B]` group advantages.
    token_scale: `[B, T]` each completion token's share of the *global*
      batch mean (`aggregation_scale` of the loss mask; 0 off it).
    token_weights: `[B, T]` per-token loss weights (attribution).
    config: clip range, dual-clip, clamps, KL weight.
    ref_logprobs: `[B, T]` frozen reference log-probs (needed if β > 0).
    entropy: `[B, T]` optional, only reported.
    sampler_logprobs: `[B, T]` the sampler's decode-time log-probs, whose
      gap to `logprobs` is reported (default: `old_logprobs`).

  Returns:
    `(loss, stats)`: stats are `token_scale`-weighted sums (exact when
    summed over micro-batches), `*_max` ones maxima over tokens
    (`combine_stats`). The train/inference mismatch, |log π − log
    π_sampler| ("logprob_gap", "logprob_gap_max") and, as verl logs it,
    |π − π_sampler| ("rollout_probs_diff_mean", "rollout_probs_diff_max"),
    and how far the update is off-policy: max |ratio − 1|
    ("ratio_deviation_max", 0 with on-policy old log-probs).
  """
  mask, mean = _weighted_mean(token_scale)
  if config.kl_beta > 0 and ref_logprobs is None:
    raise ValueError("kl_beta > 0 needs ref_logprobs")
  terms = grpo_token_terms(logprobs, old_logprobs, advantages, mask, config,
                           ref_logprobs if config.kl_beta > 0 else None)
  ratio, adv = terms["ratio"], advantages[:, None]
  # Attribution weights (App. D Eq. 16) scale the policy-gradient term
  # only; the KL regulariser stays unweighted.
  objective = terms["surrogate"] * token_weights
  # The policy-gradient term alone (App. I's Figure 4 tracks it apart
  # from the KL penalty).
  stats = {"pg_loss": -mean(jax.lax.stop_gradient(objective))}
  if "kl" in terms:
    objective = objective - config.kl_beta * terms["kl"]
    stats["kl"] = mean(terms["kl"])
  loss = -mean(objective)
  stats.update(
      loss=loss,
      clip_low_frac=mean(((ratio < 1.0 - config.epsilon_low) & (adv < 0))
                         .astype(jnp.float32)),
      clip_high_frac=mean(((ratio > 1.0 + config.epsilon_high) & (adv > 0))
                          .astype(jnp.float32)),
      # Tokens held at clip_ratio_c · A by the dual clip (verl's
      # pg_clipfrac_lower); 0 with it off.
      dual_clip_frac=(mean(((ratio > config.clip_ratio_c) & (adv < 0))
                           .astype(jnp.float32))
                      if config.clip_ratio_c else jnp.zeros(())),
      ratio_mean=mean(ratio),
      ratio_deviation_max=_masked_max(
          jax.lax.stop_gradient(jnp.abs(ratio - 1.0)), mask))
  stats.update(_mismatch(logprobs, (old_logprobs if sampler_logprobs is None
                                    else sampler_logprobs), mask, mean))
  if entropy is not None:
    stats["entropy"] = mean(jax.lax.stop_gradient(entropy))
  return loss, stats


def _mismatch(logprobs: jax.Array, sampler_logprobs: jax.Array,
              mask: jax.Array, mean) -> Stats:
  """The train/inference mismatch over the loss tokens `mask` `[B, T]`:
  mean (`mean`, the loss's own aggregation: verl's token mean in every
  config here) and max of |Δ log p| and of |Δ p|."""
  on = lambda x: jnp.where(mask > 0, jax.lax.stop_gradient(x), 0.0)  # noqa: E731
  learner, sampler = on(logprobs), on(sampler_logprobs)
  gap = jnp.abs(learner - sampler)
  probs = jnp.abs(jnp.exp(learner) - jnp.exp(sampler))
  return {"logprob_gap": mean(gap), "logprob_gap_max": _masked_max(gap, mask),
          "rollout_probs_diff_mean": mean(probs),
          "rollout_probs_diff_max": _masked_max(probs, mask)}


def sft_loss(logprobs: jax.Array, token_scale: jax.Array,
             token_weights: jax.Array, entropy: jax.Array | None = None
             ) -> tuple[jax.Array, Stats]:
  """Weighted NLL of the response tokens, averaged over the global batch.

  Args:
    logprobs: `[B, T]` log-probs of the target tokens (differentiated).
    token_scale: `[B, T]` each response token's share of the global batch
      mean (`aggregation_scale`).
    token_weights: `[B, T]` per-token loss weights.
    entropy: `[B, T]` optional, only reported.

  Returns:
    `(loss, stats)` as `grpo_loss`'s.
  """
  _, mean = _weighted_mean(token_scale)
  loss = -mean(logprobs * token_weights)
  stats = {"loss": loss, "nll": mean(-jax.lax.stop_gradient(logprobs))}
  if entropy is not None:
    stats["entropy"] = mean(jax.lax.stop_gradient(entropy))
  return loss, stats
