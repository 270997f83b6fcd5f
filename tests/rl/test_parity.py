"""Our GRPO objective against the reference trainers' own code, term by
term, on one fixed batch.

verl: `verl/trainer/ppo/core_algos.py` of verl 0.4.0 (the version
MemBuilder's launch script runs on: its `actor.checkpoint.contents`
override exists in no later verl) and 0.4.1 (the first with the ±20
log-ratio clamp, which every later verl keeps). `make test` installs both
wheels without dependencies under `.venv/reference/` (Makefile
`VERL_REF`); the module is imported by file path, openly without the
package: verl's top level starts Ray, and `verl.utils.torch_functional`
imports tensordict, transformers and flash-attn. core_algos calls one
function of it, `masked_mean`, so it gets a `verl.utils.torch_functional`
holding only that function, compiled from the installed file's own
source. The loss is composed as verl's actor composes it
(`workers/actor/dp_actor.py` 0.4.0 L391-425: `compute_policy_loss` +
`kl_loss_coef · agg_loss(kl_penalty(…, "low_var_kl"))`, entropy coefficient
0 as MemBuilder's run).

TRL 1.16.0: `GRPOTrainer._compute_loss`, the loss itself, called on a
trainer made without `__init__` (no model, no accelerate): its attributes
are the settings, its `_get_per_token_logps_and_entropies` returns the
log-prob tensor under test. Our settings are TRL's there: advantage
epsilon 1e-4, no dual-clip, no clamps.

Token weights (Eq. 16) and the validity gate are ours alone: the
references see weights 1 and valid rollouts, except where a test says how
they map onto verl (MemBuilder's attribution patch scales the advantage).
"""

import ast
import collections
import functools
import importlib.util
import pathlib
import sys
import types
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from trl.trainer import utils as trl_utils
from trl.trainer.grpo_trainer import GRPOTrainer

from cmimem_jax.rl import aggregation_scale, group_advantages, grpo_loss
from cmimem_jax.rl.losses import GRPOLossConfig, grpo_token_terms

REFERENCE = pathlib.Path(sys.prefix) / "reference"
# verl version -> our log_ratio_clamp (0.4.0 has none).
VERL = {"0.4.0": 0.0, "0.4.1": 20.0}
VERL_AGGREGATION = {"token_mean": "token-mean",
                    "sequence_mean": "seq-mean-token-mean"}
GROUPS, GROUP, T = 4, 8, 6
EPS_LOW, EPS_HIGH, DUAL_CLIP, BETA = 0.2, 0.28, 3.0, 0.02


@functools.cache
def verl_core_algos(version: str) -> types.ModuleType:
  """verl `version`'s core_algos module, imported by file path."""
  root = REFERENCE / f"verl-{version}" / "verl"
  if not root.is_dir():
    pytest.fail(f"verl {version} reference missing at {root}: `make test` "
                "installs it (Makefile VERL_REF)")
  source = root / "utils" / "torch_functional.py"
  tree = ast.parse(source.read_text())
  needed = [node for node in tree.body if isinstance(node, ast.FunctionDef)
            and node.name == "masked_mean"]
  if not needed:
    pytest.fail(f"{source} has no masked_mean")
  functional = types.ModuleType("verl.utils.torch_functional")
  exec(compile(ast.Module(body=needed, type_ignores=[]), str(source), "exec"),
       functional.__dict__)
  package, utils = types.ModuleType("verl"), types.ModuleType("verl.utils")
  package.utils, utils.torch_functional = utils, functional
  spec = importlib.util.spec_from_file_location(
      f"verl_{version.replace('.', '_')}_core_algos",
      root / "trainer" / "ppo" / "core_algos.py")
  module = importlib.util.module_from_spec(spec)
  with mock.patch.dict(sys.modules, {
      "verl": package, "verl.utils": utils,
      "verl.utils.torch_functional": functional}):
    spec.loader.exec_module(module)
  return module


def _batch(extreme: bool) -> dict[str, np.ndarray]:
  """4 groups x 8 rollouts, 6 completion slots, float32 throughout.

  Groups: ties (two at the mean: A = 0), spread, zero variance, and a
  narrow spread (std 0.006: the advantage epsilon matters). Rows hold 1-6
  tokens, padding holds finite garbage. Log-ratios: near on-policy, plus
  far off-policy tokens (|log-ratio| 1 .. log 300, past every clip) and
  reference gaps past the k3 clamp (Δ up to 6). `extreme` adds log-ratios
  and reference gaps of ±25 (past verl's ±20 clamp; only the clamps tell
  them apart).
  """
  rng = np.random.default_rng(45)
  rewards = np.array(
      [[1, .5, .5, 0, 1, .25, .75, 0],
       [.75, .5, .25, .5, 0, 1, .625, .375],
       [.5] * 8,
       [.5, .5078125, .50390625, .5, .51171875, .49609375, .5, .50390625]],
      np.float32).reshape(-1)
  rows = rewards.size
  lengths = rng.integers(1, T + 1, rows)
  lengths[:3] = (1, T, T)
  mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float32)
  old = rng.uniform(-4.0, -0.05, (rows, T))
  log_ratio = rng.normal(0.0, 0.15, (rows, T))
  far = rng.random((rows, T)) < 0.2
  log_ratio[far] = (rng.choice([-1, 1], far.sum())
                    * rng.uniform(1.0, np.log(300.0), far.sum()))
  gap = rng.normal(0.0, 0.3, (rows, T))
  wide = rng.random((rows, T)) < 0.15
  gap[wide] = rng.choice([-1, 1], wide.sum()) * rng.uniform(2.0, 6.0,
                                                            wide.sum())
  if extreme:
    log_ratio[3:7, 0] = (25.0, -25.0, 25.0, -25.0)
    gap[7:9, 0] = (25.0, -25.0)
  logp = old + log_ratio
  ref = logp + gap
  pad = mask == 0
  logp[pad], old[pad], ref[pad] = -40.0, -1.0, 30.0
  f32 = lambda x: np.asarray(x, np.float32)
  return {"rewards": rewards, "mask": mask, "logp": f32(logp),
          "old": f32(old), "ref": f32(ref)}


BATCH, EXTREME = _batch(False), _batch(True)


def ours(batch, advantages, config: GRPOLossConfig, weights=None):
  """(loss, d loss / d logp) of our objective on `batch`."""
  weights = np.ones_like(batch["mask"]) if weights is None else weights
  return _our_value_and_grad(
      jnp.asarray(batch["logp"]), jnp.asarray(batch["old"]),
      jnp.asarray(batch["ref"]), jnp.asarray(advantages),
      jnp.asarray(batch["mask"]), jnp.asarray(weights), config)


@functools.partial(jax.jit, static_argnums=(6,))
def _our_value_and_grad(logp, old, ref, adv, mask, weights, config):
  scale = aggregation_scale(mask, config.aggregation)
  return jax.value_and_grad(lambda lp: grpo_loss(
      lp, old, adv, scale, weights, config, ref_logprobs=ref)[0])(logp)


def verl_advantages(version: str, rewards: np.ndarray) -> torch.Tensor:
  """verl's GRPO advantages `[B]` (its per-token output's first column)."""
  token_rewards = torch.zeros(rewards.size, T)
  token_rewards[:, 0] = torch.from_numpy(rewards)
  index = np.repeat(np.arange(rewards.size // GROUP).astype(str), GROUP)
  advantages, _ = verl_core_algos(version).compute_grpo_outcome_advantage(
      token_level_rewards=token_rewards,
      response_mask=torch.ones(rewards.size, T), index=index)
  return advantages[:, 0]


def verl_loss(version: str, batch, advantages: torch.Tensor, aggregation: str,
              clip_ratio_c: float = DUAL_CLIP):
  """(loss, d loss / d logp) of verl's actor: `advantages` `[B]` or `[B, T]`."""
  core = verl_core_algos(version)
  logp = torch.tensor(batch["logp"], requires_grad=True)
  mask = torch.from_numpy(batch["mask"])
  mode = VERL_AGGREGATION[aggregation]
  if advantages.dim() == 1:
    advantages = advantages[:, None] * mask
  pg_loss, *_ = core.compute_policy_loss(
      old_log_prob=torch.from_numpy(batch["old"]), log_prob=logp,
      advantages=advantages, response_mask=mask, cliprange=EPS_LOW,
      cliprange_low=EPS_LOW, cliprange_high=EPS_HIGH,
      clip_ratio_c=clip_ratio_c, loss_agg_mode=mode)
  kl = core.kl_penalty(logp, torch.from_numpy(batch["ref"]), "low_var_kl")
  loss = pg_loss + BETA * core.agg_loss(loss_mat=kl, loss_mask=mask,
                                        loss_agg_mode=mode)
  loss.backward()
  return loss.item(), logp.grad.numpy()


def verl_config(version: str, aggregation: str = "token_mean"):
  return GRPOLossConfig(EPS_LOW, EPS_HIGH, BETA, aggregation,
                        clip_ratio_c=DUAL_CLIP,
                        log_ratio_clamp=VERL[version], kl_clamp=10.0)


def test_advantages_equal_verl():
  rewards = BATCH["rewards"]
  want = verl_advantages("0.4.0", rewards).numpy()
  got = group_advantages(rewards, np.ones(rewards.size), GROUP)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  assert np.all(got[16:24] == 0) and np.abs(got[24:]).max() > 1.5
  # The validity gate is ours: an invalid rollout is verl's reward 0.
  valid = np.arange(rewards.size) % 5 != 1
  np.testing.assert_allclose(
      group_advantages(rewards, valid, GROUP),
      verl_advantages("0.4.0", rewards * valid).numpy(), rtol=1e-6,
      atol=1e-6)


@pytest.mark.parametrize("version", sorted(VERL))
@pytest.mark.parametrize("batch", [BATCH, EXTREME], ids=["batch", "extreme"])
def test_token_terms_equal_verl(version, batch):
  """Per token: the ratio, the clipped and dual-clipped surrogate and k3,
  each from verl's own function on that one token."""
  core, config = verl_core_algos(version), verl_config(version)
  advantages = group_advantages(batch["rewards"], np.ones(GROUP * GROUPS),
                                GROUP)
  terms = grpo_token_terms(
      jnp.asarray(batch["logp"]), jnp.asarray(batch["old"]),
      jnp.asarray(advantages), jnp.asarray(batch["mask"]), config,
      jnp.asarray(batch["ref"]))
  one = torch.ones(1, 1)
  for b, t in zip(*np.nonzero(batch["mask"])):
    token = lambda key: torch.tensor([[batch[key][b, t]]])
    pg_loss, _, ppo_kl, _ = core.compute_policy_loss(
        old_log_prob=token("old"), log_prob=token("logp"),
        advantages=torch.tensor([[advantages[b]]]), response_mask=one,
        cliprange=EPS_LOW, cliprange_low=EPS_LOW, cliprange_high=EPS_HIGH,
        clip_ratio_c=DUAL_CLIP)
    kl = core.kl_penalty(token("logp"), token("ref"), "low_var_kl")
    where = f"row {b} token {t}"
    np.testing.assert_allclose(terms["ratio"][b, t], np.exp(-ppo_kl.item()),
                               rtol=1e-6, err_msg=where)
    np.testing.assert_allclose(terms["surrogate"][b, t], -pg_loss.item(),
                               rtol=1e-6, atol=1e-7, err_msg=where)
    # e^Δ − Δ − 1 cancels: float32 rounding of e^Δ shows in absolute terms.
    np.testing.assert_allclose(terms["kl"][b, t], kl.item(), rtol=1e-6,
                               atol=1e-6, err_msg=where)


@pytest.mark.parametrize("version", sorted(VERL))
@pytest.mark.parametrize("aggregation", sorted(VERL_AGGREGATION))
@pytest.mark.parametrize("batch", [BATCH, EXTREME], ids=["batch", "extreme"])
def test_loss_and_gradient_equal_verl(version, aggregation, batch):
  """Advantages, loss and d loss / d log-probs end to end; weights 1, every
  rollout valid."""
  rewards = batch["rewards"]
  loss, grad = ours(batch, group_advantages(rewards, np.ones(rewards.size),
                                            GROUP),
                    verl_config(version, aggregation))
  want_loss, want_grad = verl_loss(version, batch,
                                   verl_advantages(version, rewards),
                                   aggregation)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-8)


def test_token_weights_are_verl_with_scaled_advantages():
  """Eq. 16's weights (> 0) scale the policy-gradient term where
  MemBuilder's attribution patch scales verl's advantage; the KL stays
  unweighted in both. Weights 1 are the plain objective."""
  rewards = BATCH["rewards"]
  advantages = group_advantages(rewards, np.ones(rewards.size), GROUP)
  weights = np.where(np.arange(T)[None] % 3 == 0, 4.0, 1.0) * np.ones(
      (rewards.size, 1), np.float32)
  loss, grad = ours(BATCH, advantages, verl_config("0.4.1"), weights)
  scaled = verl_advantages("0.4.1", rewards)[:, None] * torch.from_numpy(
      weights * BATCH["mask"])
  want_loss, want_grad = verl_loss("0.4.1", BATCH, scaled, "token_mean")
  np.testing.assert_allclose(loss, want_loss, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-8)
  plain, _ = ours(BATCH, advantages, verl_config("0.4.1"))
  assert abs(float(plain) - float(loss)) > 1e-3


def test_clamps_match_their_verl_versions():
  """Past ±20 the two verl versions disagree, and each agrees with our
  matching `log_ratio_clamp` (dual-clip off: verl's clip_ratio_c can only
  be made too large to bind)."""
  advantages = group_advantages(EXTREME["rewards"], np.ones(GROUP * GROUPS),
                                GROUP)
  results = {}
  for version, clamp in VERL.items():
    config = GRPOLossConfig(EPS_LOW, EPS_HIGH, BETA, clip_ratio_c=0.0,
                            log_ratio_clamp=clamp, kl_clamp=10.0)
    loss, grad = ours(EXTREME, advantages, config)
    want_loss, want_grad = verl_loss(
        version, EXTREME, verl_advantages(version, EXTREME["rewards"]),
        "token_mean", clip_ratio_c=1e30)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-8)
    results[version] = float(loss)
  assert results["0.4.0"] > 10 * results["0.4.1"] > 0


def trl_advantages(rewards: np.ndarray) -> np.ndarray:
  """TRL 1.16.0's group advantages: `grpo_trainer.py` L2765-2787 (inline in
  `_generate_and_score_completions`, scale_rewards="group"), with TRL's
  own `nanstd`."""
  rewards = torch.from_numpy(rewards)
  mean = torch.nanmean(rewards.view(-1, GROUP), dim=1)
  std = trl_utils.nanstd(rewards.view(-1, GROUP), dim=1)
  advantages = rewards - mean.repeat_interleave(GROUP)
  return (advantages / (std.repeat_interleave(GROUP) + 1e-4)).numpy()


def trl_loss(loss_type: str, batch, advantages: np.ndarray):
  """(loss, d loss / d logp) of `GRPOTrainer._compute_loss`."""
  logp = torch.tensor(batch["logp"], requires_grad=True)
  mask = torch.from_numpy(batch["mask"]).long()
  rows = mask.shape[0]
  trainer = object.__new__(GRPOTrainer)
  vars(trainer).update(
      loss_type=loss_type, epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH,
      beta=BETA, importance_sampling_level="token", top_entropy_quantile=1.0,
      off_policy_mask_threshold=None, use_vllm=False,
      vllm_importance_sampling_correction=False, aux_loss_enabled=False,
      _entropy_bonus_enabled=False, current_gradient_accumulation_steps=1,
      args=types.SimpleNamespace(delta=None, use_bias_correction_kl=False,
                                 steps_per_generation=1),
      model=torch.nn.Module(),  # In training mode.
      accelerator=types.SimpleNamespace(
          gather=lambda x: x, reduce=lambda x, reduction: x,
          num_processes=1),
      _metrics={"train": collections.defaultdict(list)},
      _get_per_token_logps_and_entropies=(
          lambda *args, **kwargs: (logp, torch.zeros_like(logp), None)))
  inputs = {
      "prompt_ids": torch.zeros(rows, 1, dtype=torch.long),
      "prompt_mask": torch.ones(rows, 1, dtype=torch.long),
      "completion_ids": torch.zeros(rows, T, dtype=torch.long),
      "completion_mask": mask,
      "advantages": torch.from_numpy(advantages),
      "old_per_token_logps": torch.from_numpy(batch["old"]),
      "ref_per_token_logps": torch.from_numpy(batch["ref"]),
      "num_items_in_batch": mask.sum()}
  loss = GRPOTrainer._compute_loss(trainer, None, inputs)
  loss.backward()
  return loss.item(), logp.grad.numpy()


TRL_CONFIG = {"clip_ratio_c": 0.0, "log_ratio_clamp": 0.0, "kl_clamp": 0.0}


def test_advantages_equal_trl():
  rewards = BATCH["rewards"]
  np.testing.assert_allclose(
      group_advantages(rewards, np.ones(rewards.size), GROUP, eps=1e-4),
      trl_advantages(rewards), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("aggregation,loss_type", [
    ("token_mean", "bnpo"), ("token_mean", "dapo"),
    ("sequence_mean", "grpo")])
def test_loss_and_gradient_equal_trl(aggregation, loss_type):
  rewards = BATCH["rewards"]
  advantages = group_advantages(rewards, np.ones(rewards.size), GROUP,
                                eps=1e-4)
  loss, grad = ours(BATCH, advantages, GRPOLossConfig(
      EPS_LOW, EPS_HIGH, BETA, aggregation, **TRL_CONFIG))
  want_loss, want_grad = trl_loss(loss_type, BATCH, advantages)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-8)
