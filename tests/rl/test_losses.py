"""GRPO loss and advantages against hand-computed values."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cmimem_jax.rl import (GRPOLossConfig, aggregation_scale,
                           group_advantages, grpo_loss, k3_kl)


def test_advantages_hand_computed():
  rewards = np.array([1.0, 0.0, 0.5, 0.5, 0.2, 0.2, 0.2, 0.2])
  valid = np.array([1, 1, 1, 0, 1, 1, 1, 1])
  adv = group_advantages(rewards, valid, group_size=4)
  gated = np.array([1.0, 0.0, 0.5, 0.0])  # Invalid rollout counts as 0.
  mean, std = 0.375, math.sqrt(np.sum((gated - 0.375) ** 2) / 3)
  np.testing.assert_allclose(adv[:4], (gated - mean) / (std + 1e-6),
                             rtol=1e-6)
  # All-equal group: zero advantage, no NaN.
  np.testing.assert_array_equal(adv[4:], 0.0)
  np.testing.assert_array_equal(group_advantages(np.ones(3), np.ones(3), 1), 0)


def test_advantages_reject_bad_shapes_and_nan():
  with pytest.raises(ValueError, match="multiple of group_size"):
    group_advantages(np.ones(5), np.ones(5), 2)
  with pytest.raises(ValueError, match="rows \\[1\\]"):
    group_advantages(np.array([0.0, np.nan]), np.ones(2), 2)


def test_k3_is_zero_at_equality_and_positive_otherwise():
  lp = jnp.array([-1.0, -2.0])
  np.testing.assert_allclose(k3_kl(lp, lp), 0.0)
  ref = jnp.array([-1.5, -1.0])
  delta = np.array([-0.5, 1.0])
  np.testing.assert_allclose(k3_kl(lp, ref), np.exp(delta) - delta - 1,
                             rtol=1e-6)


def _loss(logp, old, adv, mask, weights, config, ref=None):
  scale = aggregation_scale(jnp.asarray(mask), config.aggregation)
  return grpo_loss(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv),
                   scale, jnp.asarray(weights), config,
                   ref_logprobs=None if ref is None else jnp.asarray(ref))


def test_clipped_surrogate_both_sides_hand_computed():
  config = GRPOLossConfig(epsilon_low=0.1, epsilon_high=0.3, kl_beta=0.0)
  # Row 0: A = +1; ratios 2.0 (clipped at 1.3), 0.5 (unclipped: min picks it).
  # Row 1: A = -1; ratios 0.5 (clipped at 0.9 -> -0.9), 2.0 (-2.0 kept).
  old = np.log(np.array([[0.2, 0.4, 0.3], [0.4, 0.2, 0.3]]))
  logp = np.log(np.array([[0.4, 0.2, 0.9], [0.2, 0.4, 0.9]]))
  mask = np.array([[1, 1, 0], [1, 1, 0]])  # Last column: padding.
  loss, stats = _loss(logp, old, [1.0, -1.0], mask, np.ones((2, 3)), config)
  per_token = [1.3, 0.5, -0.9, -2.0]
  np.testing.assert_allclose(loss, -np.mean(per_token), rtol=1e-6)
  np.testing.assert_allclose(stats["pg_loss"], loss, rtol=1e-6)
  np.testing.assert_allclose(stats["clip_high_frac"], 0.25, rtol=1e-6)
  np.testing.assert_allclose(stats["clip_low_frac"], 0.25, rtol=1e-6)
  np.testing.assert_allclose(stats["ratio_mean"], (2 + .5 + .5 + 2) / 4,
                             rtol=1e-6)
  assert "kl" not in stats


def test_kl_weights_and_masks_hand_computed():
  config = GRPOLossConfig(kl_beta=0.5)
  logp = np.log(np.array([[0.5, 0.5, 0.25]]))
  old = logp.copy()                       # ratio 1: surrogate = A.
  ref = np.log(np.array([[0.25, 0.5, 0.5]]))
  weights = np.array([[4.0, 1.0, 2.0]])
  mask = np.array([[1, 1, 1]])
  loss, stats = _loss(logp, old, [2.0], mask, weights, config, ref)
  kl = np.exp(np.log([0.5, 1.0, 2.0])) - np.log([0.5, 1.0, 2.0]) - 1
  # Eq. 16: the weights scale the policy-gradient term, not the KL.
  want = -np.mean(weights[0] * 2.0 - 0.5 * kl)
  np.testing.assert_allclose(loss, want, rtol=1e-6)
  np.testing.assert_allclose(stats["kl"], kl.mean(), rtol=1e-6)
  # The policy-gradient term alone: the loss without its KL penalty.
  np.testing.assert_allclose(stats["pg_loss"], -np.mean(weights[0] * 2.0),
                             rtol=1e-6)
  with pytest.raises(ValueError, match="ref_logprobs"):
    _loss(logp, old, [2.0], mask, weights, config)


def test_empty_completions_give_zero_loss_not_nan():
  config = GRPOLossConfig()
  zeros = np.zeros((2, 3))
  # Padding positions may hold anything: here log-probs whose ratio and
  # k3 terms overflow to inf.
  loss, stats = _loss(zeros - 1e4, zeros, [1.0, -1.0], zeros.astype(int),
                      zeros + 1, config, zeros)
  assert float(loss) == 0.0
  assert all(np.isfinite(float(v)) for v in stats.values())


def test_sequence_mean_weighs_rows_not_tokens():
  """GRPO paper: each row's tokens averaged, then the rows; verl's token
  mean weighs a 3-token row three times a 1-token row."""
  logp = np.log(np.array([[0.5, 0.5, 0.5], [0.5, 0.9, 0.9]]))
  mask = np.array([[1, 1, 1], [1, 0, 0]])
  adv = [1.0, -3.0]  # ratio 1: each token's surrogate is its advantage.
  token, _ = _loss(logp, logp, adv, mask, np.ones((2, 3)),
                   GRPOLossConfig(kl_beta=0.0))
  sequence, _ = _loss(logp, logp, adv, mask, np.ones((2, 3)),
                      GRPOLossConfig(kl_beta=0.0, aggregation="sequence_mean"))
  np.testing.assert_allclose(token, -(3 * 1.0 - 3.0) / 4, atol=1e-7)
  np.testing.assert_allclose(sequence, -(1.0 - 3.0) / 2, rtol=1e-6)
  scale = aggregation_scale(jnp.asarray(mask), "sequence_mean")
  np.testing.assert_allclose(scale, [[1 / 6] * 3, [0.5, 0, 0]], rtol=1e-6)
  with pytest.raises(ValueError, match="aggregation"):
    GRPOLossConfig(aggregation="sum")


def test_dual_clip_bounds_negative_advantages_hand_computed():
  """verl's dual-clip: where A < 0 the objective is at least c · A."""
  old = np.log(np.array([[0.1, 0.1, 0.1]]))
  logp = np.log(np.array([[0.5, 0.25, 0.05]]))  # Ratios 5, 2.5, 0.5.
  mask, ones = np.ones((1, 3)), np.ones((1, 3))
  per_token = {3.0: [-3.0, -2.5, -0.8], 0.0: [-5.0, -2.5, -0.8]}
  for c, want in per_token.items():
    config = GRPOLossConfig(kl_beta=0.0, clip_ratio_c=c)
    loss, stats = _loss(logp, old, [-1.0], mask, ones, config)
    np.testing.assert_allclose(loss, -np.mean(want), rtol=1e-6)
    np.testing.assert_allclose(stats["dual_clip_frac"], 1 / 3 if c else 0,
                               rtol=1e-6)
  # A > 0 is never dual-clipped: ratio 5 is held at 1 + ε as without it.
  loss, _ = _loss(logp, old, [1.0], mask, ones, GRPOLossConfig(kl_beta=0.0))
  np.testing.assert_allclose(loss, -np.mean([1.2, 1.2, 0.5]), rtol=1e-6)


def test_log_ratio_clamp_keeps_far_tokens_finite():
  """A log-ratio past exp()'s float32 range at A = 0 (a zero-variance
  group) is inf · 0 = NaN without verl's ±20 clamp."""
  logp, old = np.array([[0.0, -1.0]]), np.array([[-100.0, -1.0]])
  ref = np.array([[-100.0, -1.0]])
  mask, ones = np.ones((1, 2)), np.ones((1, 2))

  def value_and_grad(config):
    scale = aggregation_scale(jnp.asarray(mask), config.aggregation)
    return jax.value_and_grad(lambda lp: grpo_loss(
        lp, jnp.asarray(old), jnp.asarray([0.0]), scale, jnp.asarray(ones),
        config, ref_logprobs=jnp.asarray(ref))[0])(jnp.asarray(logp))

  loss, grad = value_and_grad(GRPOLossConfig())
  assert np.isfinite(float(loss)) and np.all(np.isfinite(grad))
  # k3 at Δ = -20: e^-20 + 19, clamped to 10; the other token's k3 is 0.
  np.testing.assert_allclose(loss, 0.02 * 10 / 2, rtol=1e-6)
  loss, _ = value_and_grad(GRPOLossConfig(log_ratio_clamp=0.0, kl_clamp=0.0))
  assert np.isnan(float(loss))


def test_clip_options_are_validated_and_read_from_config():
  with pytest.raises(ValueError, match="clip_ratio_c=1.0: must be 0"):
    GRPOLossConfig(clip_ratio_c=1.0)
  with pytest.raises(ValueError, match="kl_clamp=-1.0: must be >= 0"):
    GRPOLossConfig(kl_clamp=-1.0)
  from cmimem_jax.config import ConfigError, validate_config
  from cmimem_jax.task.loop import RLConfig
  from configs import tiny
  config = tiny.get_config()
  config.rl.update({"clip_ratio_c": 0.0, "log_ratio_clamp": 5.0})
  loss = RLConfig.from_config(config.rl).loss_config()
  assert (loss.clip_ratio_c, loss.log_ratio_clamp, loss.kl_clamp) == (
      0.0, 5.0, 10.0)
  config.rl.clip_ratio_c = 0.5
  with pytest.raises(ConfigError, match=r"rl.clip_ratio_c=0.5: must be 0"):
    validate_config(config, required=(RLConfig,))
