"""The sharded GRPO train step: accumulation, 1 vs 8 devices, learning,
checkpoint resume."""

import dataclasses
import functools
import glob
import logging
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl import logging as absl_logging
from flax import nnx
from jax.sharding import PartitionSpec as P

from cmimem_jax.models.qwen3 import Qwen3, preset
from cmimem_jax.parallel import make_mesh
from cmimem_jax.rl import (Checkpointer, GRPOLossConfig, Learner,
                           MetricsWriter, OptimizerConfig, SFTLossConfig,
                           TrainStepConfig, accumulated_grads,
                           group_advantages, read_metrics, rollout_batch,
                           shared_prompt_group, supervised_batch,
                           token_logprobs)
from cmimem_jax.rl.trainer import step_compiler_options
from cmimem_jax.sampling import Sampler, SamplingConfig

VOCAB = 64


def tiny_model(seed: int = 0) -> Qwen3:
  return Qwen3(preset("tiny", vocab_size=VOCAB), rngs=nnx.Rngs(seed))


def synthetic_batch(step: int, rows: int = 8, prompt: int = 6,
                    completion: int = 5) -> dict[str, np.ndarray]:
  """A deterministic batch per step: left-padded prompts, ragged
  completions (one empty), attribution weights."""
  rng = np.random.default_rng(step)
  t = prompt + completion
  tokens = rng.integers(1, VOCAB, (rows, t)).astype(np.int32)
  prompt_len = rng.integers(2, prompt + 1, rows)
  comp_len = rng.integers(0, completion + 1, rows)
  cols = np.arange(t)[None]
  mask = ((cols >= prompt - prompt_len[:, None])
          & (cols < prompt + comp_len[:, None])).astype(np.int32)
  loss_mask = ((cols >= prompt) & (mask > 0)).astype(np.int32)
  rewards = rng.random(rows)
  return {
      "tokens": tokens * mask, "mask": mask, "loss_mask": loss_mask,
      "old_logprobs": (-3.0 - rng.random((rows, t))).astype(np.float32)
      * loss_mask,
      "advantages": group_advantages(rewards, np.ones(rows), 4),
      "token_weights": np.where(rng.random((rows, t)) < 0.3, 4.0, 1.0
                                ).astype(np.float32) * loss_mask,
  }


def config(micro_batches=1, lr=1e-3, kl_beta=0.02, aggregation="token_mean"):
  return TrainStepConfig(
      loss=GRPOLossConfig(kl_beta=kl_beta, aggregation=aggregation),
      optimizer=OptimizerConfig(learning_rate=lr, grad_clip_norm=1.0),
      micro_batches=micro_batches, temperature=0.8, logprob_chunk=4)


def one_device_mesh():
  return make_mesh("data:1", devices=jax.devices()[:1])


def test_chunked_logprobs_equal_full_log_softmax():
  model = tiny_model()
  batch = synthetic_batch(0)
  logp, entropy = token_logprobs(model, batch["tokens"], batch["mask"],
                                 temperature=0.8, chunk=3)
  logits, _ = model(jnp.asarray(batch["tokens"]),
                    attention_mask=jnp.asarray(batch["mask"]))
  full = jax.nn.log_softmax(logits[:, :-1] / 0.8, axis=-1)
  want = np.take_along_axis(np.asarray(full),
                            batch["tokens"][:, 1:, None], -1)[..., 0]
  np.testing.assert_allclose(np.asarray(logp)[:, 1:], want, atol=1e-6)
  np.testing.assert_allclose(
      np.asarray(entropy)[:, 1:],
      -np.sum(np.exp(full) * full, axis=-1), atol=1e-5)
  assert np.all(np.asarray(logp)[:, 0] == 0)


def test_logprob_gradients_match_with_and_without_chunk_remat():
  """Several chunks (rematerialised LM head) and a single chunk (no remat)
  give the same gradients."""
  model = tiny_model()
  graphdef, state = nnx.split(model, nnx.Param)
  batch = synthetic_batch(0)
  weights = jnp.asarray(np.random.default_rng(1).standard_normal(
      batch["tokens"].shape), jnp.float32)

  def grads(chunk):
    def loss(params):
      logp, entropy = token_logprobs(
          nnx.merge(graphdef, params), batch["tokens"], batch["mask"],
          temperature=0.8, chunk=chunk)
      return jnp.sum(weights * logp) + 0.1 * jnp.sum(entropy)
    return jax.grad(loss)(nnx.to_pure_dict(state))

  chunked, single = grads(3), grads(batch["tokens"].shape[1])
  # Only the float32 summation order over chunks differs.
  for a, b in zip(jax.tree.leaves(chunked), jax.tree.leaves(single)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_gradient_accumulation_equals_full_batch(aggregation):
  model = tiny_model()
  graphdef, state = nnx.split(model, nnx.Param)
  params = nnx.to_pure_dict(state)
  mesh = one_device_mesh()
  batch = {k: jnp.asarray(v) for k, v in synthetic_batch(1).items()}
  grads = {}
  for k in (1, 4):
    fn = jax.jit(functools.partial(
        accumulated_grads, graphdef, config(k, aggregation=aggregation), mesh))
    grads[k], stats = fn(params, batch, params)
    assert np.isfinite(float(stats["loss"]))
  for a, b in zip(jax.tree.leaves(grads[1]), jax.tree.leaves(grads[4])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_frozen_parameters_get_no_gradient_and_no_weight_gradient_work():
  """`trainable` keeps the full gradient of the parameters it names (here
  the RMSNorm scales, as an adapter update's floor), zero for the rest,
  and the backward leaves out the frozen weights' gradient matmuls."""
  graphdef, state = nnx.split(tiny_model(), nnx.Param)
  params = nnx.to_pure_dict(state)
  batch = {k: jnp.asarray(v) for k, v in synthetic_batch(1).items()}
  results, dots = [], []
  for trainable in (None, lambda path: path.endswith("norm")):
    fn = functools.partial(accumulated_grads, graphdef, config(),
                           one_device_mesh(), trainable=trainable)
    dots.append(str(jax.make_jaxpr(fn)(params, batch, params)).count(
        "dot_general"))
    results.append(jax.jit(fn)(params, batch, params))
  (full, full_stats), (norms, norm_stats) = results
  np.testing.assert_allclose(norm_stats["loss"], full_stats["loss"])
  flat_full = dict(jax.tree_util.tree_flatten_with_path(full)[0])
  for path, grad in jax.tree_util.tree_flatten_with_path(norms)[0]:
    name = jax.tree_util.keystr(path, simple=True, separator="/")
    if name.endswith("norm"):
      assert np.abs(np.asarray(grad)).max() > 0, name
      np.testing.assert_allclose(grad, flat_full[path], rtol=1e-5, atol=1e-7)
    else:
      assert not np.asarray(grad).any(), name
  assert dots[1] < dots[0], dots


def shared_prompt_batch(step: int, prompts: int = 2, group: int = 4
                        ) -> dict[str, np.ndarray]:
  """`synthetic_batch` whose rows come in groups of `group` sharing their
  prompt columns (the first 6), as a sampler's rollouts do."""
  batch = synthetic_batch(step, rows=prompts * group)
  for key in ("tokens", "mask"):
    batch[key][:, :6] = np.repeat(batch[key][::group, :6], group, axis=0)
  return batch


def test_shared_prompt_group_finds_runs_that_fit_the_split():
  batch = shared_prompt_batch(0, prompts=4, group=4)
  tokens, mask = batch["tokens"], batch["mask"]
  assert shared_prompt_group(tokens, mask, 6) == 4
  # 4 prompts over 8 micro-batch x shard parts: groups of 2 give 8.
  assert shared_prompt_group(tokens, mask, 6, groups_divisor=8) == 2
  assert shared_prompt_group(tokens, mask, 6, groups_divisor=32) == 1
  # The first two prompts equal: runs of 8, 4, 4 share groups of 4.
  same, same_mask = tokens.copy(), mask.copy()
  same[4:8, :6], same_mask[4:8, :6] = same[0, :6], same_mask[0, :6]
  assert shared_prompt_group(same, same_mask, 6) == 4
  # A row that differs in its prompt's mask alone breaks its run.
  broken = mask.copy()
  broken[1, 0] = 1 - broken[1, 0]
  assert shared_prompt_group(tokens, broken, 6) == 1
  assert shared_prompt_group(synthetic_batch(0)["tokens"],
                             synthetic_batch(0)["mask"], 6) == 1


def test_rows_sharing_a_prompt_take_the_same_step_computing_it_once():
  """Groups of 4 rows with one prompt each: the step that runs each prompt
  once (`share_prompts`) gives the loss, statistics and update of the
  step over whole rows. Two micro-batches: the groups stay whole in each
  (one micro-batch is the same scan with k = 1)."""
  batch = shared_prompt_batch(5)
  results = {}
  for share in (True, False):
    step_config = dataclasses.replace(config(micro_batches=2, lr=4e-6),
                                      share_prompts=share)
    learner = Learner(tiny_model(), step_config, one_device_mesh())
    results[share] = (learner.step(batch), jax.device_get(learner.params))
  (shared, shared_params), (whole, whole_params) = results[True], results[False]
  assert shared["prompt_group"] == 4 and whole["prompt_group"] == 1
  for key in ("loss", "pg_loss", "kl", "grad_norm", "entropy", "ratio_mean"):
    np.testing.assert_allclose(shared[key], whole[key], rtol=1e-5, atol=1e-7)
  for a, b in zip(jax.tree.leaves(shared_params),
                  jax.tree.leaves(whole_params)):
    np.testing.assert_allclose(a, b, atol=1e-5)


def test_shared_prompt_logprobs_on_splash_equal_whole_rows():
  """TPU's shared-prompt path (the splash kernel over packed `[prompt;
  rows]` sequences, interpret mode here), sharded as the learner shards
  it (4 prompts over data x fsdp, heads over tensor): the log-probs and
  entropies of computing each prompt once equal the whole rows'."""
  if len(jax.devices()) < 8:
    pytest.skip("needs the 8 fake CPU devices set up in conftest")
  model = Qwen3(preset("tiny", vocab_size=VOCAB, attention_impl="splash"),
                rngs=nnx.Rngs(0))
  batch = shared_prompt_batch(3, prompts=4, group=2)
  tokens, mask = jnp.asarray(batch["tokens"]), jnp.asarray(batch["mask"])
  real = batch["loss_mask"].astype(bool)
  whole = token_logprobs(model, tokens, mask, start=6)
  mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  with jax.set_mesh(mesh):
    shared = nnx.jit(lambda m, t, k: token_logprobs(
        m, t, k, start=6, mesh=mesh, group=2))(model, tokens, mask)
  for got, want in zip(shared, whole):
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real],
                               atol=2e-5)


def test_same_step_on_one_and_eight_devices():
  if len(jax.devices()) < 8:
    pytest.skip("needs the 8 fake CPU devices set up in conftest")
  # lr small enough that Adam's ~lr-sized sign-like first update cannot
  # amplify float32 reduction-order noise beyond the 1e-5 tolerance.
  # Rows of their own prompts, and 8 prompts of 2 rows each (each prompt
  # run once: the groups stay whole across micro-batches and shards).
  for batch in (synthetic_batch(2), shared_prompt_batch(2, 8, 2)):
    results = {}
    for name, mesh in (("one", one_device_mesh()),
                       ("eight", make_mesh("fsdp:4,tensor:2"))):
      trainer = Learner(tiny_model(), config(micro_batches=2, lr=4e-6), mesh)
      metrics = trainer.step(batch)
      results[name] = (metrics, jax.device_get(trainer.params), trainer)
    one, eight = results["one"], results["eight"]
    assert one[0]["prompt_group"] == eight[0]["prompt_group"]
    for key in ("loss", "pg_loss", "kl", "grad_norm", "entropy",
                "clip_low_frac"):
      np.testing.assert_allclose(one[0][key], eight[0][key], rtol=1e-5,
                                 atol=1e-6)
    for a, b in zip(jax.tree.leaves(one[1]), jax.tree.leaves(eight[1])):
      np.testing.assert_allclose(a, b, atol=1e-5)
  assert one[0]["prompt_group"] == 2
  trainer = eight[2]
  q_proj = trainer.params["layers"]["q_proj"]
  assert q_proj.sharding.spec == P(None, "fsdp", "tensor")
  assert {s.data.shape for s in q_proj.addressable_shards} == {(2, 16, 48)}
  moments = [x for x in jax.tree.leaves(trainer.opt_state)
             if x.shape == q_proj.shape]
  assert moments and all(m.sharding.spec == q_proj.sharding.spec
                         for m in moments)


def test_learners_of_one_model_and_objective_share_their_compiled_step(
    compiles):
  """A second learner (a resumed run, a second trainer in one process)
  reuses the first one's compiled step with its own weights; a model that
  differs in a static setting compiles its own."""
  mesh, batch = one_device_mesh(), synthetic_batch(0)
  first = Learner(tiny_model(0), config(), mesh).step(batch)
  before = compiles.count
  second = Learner(tiny_model(1), config(), mesh).step(batch)
  assert compiles.count == before
  assert second["loss"] != first["loss"]  # Its own weights, not the first's.
  other = Qwen3(preset("tiny", vocab_size=VOCAB, attention_impl="per_head"),
                rngs=nnx.Rngs(1))
  third = Learner(other, config(), mesh).step(batch)
  assert compiles.count > before
  assert third["loss"] == pytest.approx(second["loss"], abs=1e-5)


def test_the_cpu_step_is_compiled_for_memory():
  """On CPU the step is scheduled for memory (host memory is what runs
  out there): its temporaries are below those of XLA:CPU's default
  schedule (1.27 -> 1.08 GiB for configs/default.py's step)."""
  mesh, batch = one_device_mesh(), synthetic_batch(0)
  learner = Learner(tiny_model(0), config(), mesh)
  assert step_compiler_options(mesh)
  args = learner._step_args(batch)
  with jax.set_mesh(mesh):
    default = learner._programs.step.lower(*args).compile()
  temporaries = learner.compiled(batch).memory_analysis().temp_size_in_bytes
  assert temporaries < default.memory_analysis().temp_size_in_bytes


def test_batch_validation_messages():
  trainer = Learner(tiny_model(), config(micro_batches=3),
                    one_device_mesh())
  with pytest.raises(ValueError, match="3 micro-batches"):
    trainer.step(synthetic_batch(0))
  with pytest.raises(ValueError, match="lacks"):
    trainer.step({"tokens": np.zeros((6, 4), np.int32)})


def _train(trainer, steps):
  return [trainer.step(synthetic_batch(s)) for s in steps]


def test_resume_is_bit_exact_and_survives_a_corrupt_checkpoint(tmp_path):
  straight = Learner(tiny_model(), config(), one_device_mesh())
  _train(straight, range(4))
  want = jax.device_get(straight.params)

  key = jax.random.key(7)
  first = Learner(tiny_model(), config(), one_device_mesh())
  ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=2)
  for step in range(3):
    _train(first, [step])
    ckpt.save(step + 1, first.params, first.opt_state, key,
              {"data_position": step + 1})
  ckpt.wait()
  assert ckpt.steps() == [2, 3]

  # Resume from step 2 as a fresh process would (restore the newest, then
  # corrupt it and check the fallback), then continue with steps 2 and 3.
  # Different initial weights (the checkpoint must overwrite them); the KL
  # reference is the run's fixed initial policy, as a real resume reloads.
  resumed = Learner(tiny_model(seed=1), config(), one_device_mesh(),
                    reference=tiny_model(seed=0))
  for path in glob.glob(str(tmp_path / "ckpt" / "3" / "state" / "**"),
                        recursive=True):
    if os.path.isfile(path):
      with open(path, "wb") as f:
        f.write(b"garbage")
  restored = Checkpointer(str(tmp_path / "ckpt")).restore(
      resumed.params, resumed.opt_state, jax.random.key(0))
  assert restored.step == 2 and restored.skipped == [3]
  assert restored.loop_state == {"data_position": 2}
  assert jax.random.key_data(restored.rng).tolist() == \
      jax.random.key_data(key).tolist()
  assert restored.params["embed"].sharding == resumed.params["embed"].sharding
  resumed.params, resumed.opt_state = restored.params, restored.opt_state
  _train(resumed, range(restored.loop_state["data_position"], 4))
  for a, b in zip(jax.tree.leaves(want),
                  jax.tree.leaves(jax.device_get(resumed.params))):
    np.testing.assert_array_equal(a, b)


def test_no_checkpoint_restores_none(tmp_path):
  trainer = Learner(tiny_model(), config(kl_beta=0.0), one_device_mesh())
  assert trainer.ref_params is None
  assert Checkpointer(str(tmp_path)).restore(
      trainer.params, trainer.opt_state, jax.random.key(0)) is None


# Saves ~400 MB of state asynchronously, writing at most argv[3] GB at
# once, and reports how much more is resident once the save has finished
# (waited for by `Checkpointer.wait`, or, the control, by orbax's manager
# alone) and how far above the resident size before it the peak went.
_SAVE_SCRIPT = """
import sys
import jax
from cmimem_jax.models.host_memory import return_large_blocks
from cmimem_jax.rl import Checkpointer
def rss():
  with open("/proc/self/status") as f:
    return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 1024
return_large_blocks()  # As the trainer runs.
keys = jax.random.split(jax.random.key(0), 20)
params = {f"w{i}": jax.random.normal(k, (2_500_000,)) for i, k in enumerate(keys)}
opt_state = jax.tree.map(lambda p: p * 0.5, params)
jax.block_until_ready((params, opt_state))
before = rss()
with open("/proc/self/clear_refs", "w") as f:
  f.write("5")  # The peak RSS (VmHWM) starts again from here.
checkpointer = Checkpointer(sys.argv[1], save_concurrent_gb=float(sys.argv[3]))
checkpointer.save(1, params, opt_state, jax.random.key(1), {"step": 1})
if sys.argv[2] == "checkpointer":
  checkpointer.wait()
else:
  checkpointer.manager.wait_until_finished()
with open("/proc/self/status") as f:
  peak = next(int(l.split()[1]) for l in f if l.startswith("VmHWM")) / 1024
print(rss() - before, peak - before)
"""


def test_a_save_is_bounded_and_leaves_no_host_copies_resident(tmp_path):
  def save(wait: str, concurrent_gb: float) -> tuple[float, float]:
    out = subprocess.run(
        [sys.executable, "-c", _SAVE_SCRIPT, str(tmp_path / wait), wait,
         str(concurrent_gb)],
        check=True, capture_output=True, text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"})
    retained, peak = out.stdout.strip().splitlines()[-1].split()
    return float(retained), float(peak)
  # Orbax's manager alone leaves a large share of the 400 MB resident (the
  # test can fail: 95 MB to well over 100 by the machine's load);
  # `Checkpointer.wait` returns it.
  retained, unbounded_peak = save("manager", 96)
  assert retained > 60
  retained, bounded_peak = save("checkpointer", 0.04)
  assert retained < 40
  # 40 MB at a time, the peak stays near the bound (47 MiB measured); all
  # at once, tensorstore held copies of much of the state (+211 to +359
  # MiB on this machine, depending on the load).
  assert bounded_peak < 100 and unbounded_peak > bounded_peak + 100
  with pytest.raises(ValueError, match="save_concurrent_gb must be > 0"):
    Checkpointer(str(tmp_path / "bad"), save_concurrent_gb=0)


_TENSORBOARD_SCRIPT = """
import sys
from cmimem_jax.rl.metrics import MetricsWriter
writer = MetricsWriter(sys.argv[1], tensorboard=True, progress=False)
writer.write(1, {"loss": 0.5, "reward_mean": 0.25, "sessions": ["a/0"]})
writer.write(2, {"loss": 0.125, "reward_mean": 0.75, "valid": True})
writer.close()
print(sorted(m for m in sys.modules if m.split(".")[0] == "torch"))
"""


def _tensorboard_scalars(directory) -> dict[tuple[int, str], float]:
  """(step, tag) -> value of every scalar in a TensorBoard events file
  (TFRecords of `Event` protos)."""
  from tensorboardX.proto import event_pb2
  (path,) = directory.glob("events.out.tfevents.*")
  data, scalars = path.read_bytes(), {}
  offset = 0
  while offset < len(data):
    length = int.from_bytes(data[offset:offset + 8], "little")
    event = event_pb2.Event.FromString(
        data[offset + 12:offset + 12 + length])
    offset += 12 + length + 4  # Length, its CRC, the record, its CRC.
    for value in event.summary.value:
      scalars[(event.step, value.tag)] = value.simple_value
  return scalars


def test_tensorboard_scalars_are_written_without_importing_torch(tmp_path):
  # tensorboardX's writer imports torch when it is installed (as here);
  # the training processes import it without (`_summary_writer_class`).
  out = subprocess.run([sys.executable, "-c", _TENSORBOARD_SCRIPT,
                        str(tmp_path)], check=True, capture_output=True,
                       text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert out.stdout.strip().splitlines()[-1] == "[]"
  assert _tensorboard_scalars(tmp_path / "tensorboard") == {
      (1, "loss"): 0.5, (1, "reward_mean"): 0.25,
      (2, "loss"): 0.125, (2, "reward_mean"): 0.75}


def test_on_policy_old_logprobs_give_ratio_one_and_verls_update():
  """`old_logprobs="learner"`: the ratio is exactly 1 on every token however
  far the sampler's log-probs are (nothing clipped), over two accumulated
  micro-batches; the update is verl's on-policy one (old log-probs from a
  separate forward of the same weights, passed as the sampler's); the
  mismatch is logged against the host-computed gap."""
  batch = synthetic_batch(2)  # Sampler log-probs in [-4, -3]: far off.
  mesh = one_device_mesh()

  def step_config(old_logprobs):
    return dataclasses.replace(config(micro_batches=2), loss=GRPOLossConfig(
        epsilon_high=0.28, old_logprobs=old_logprobs))

  own, _ = token_logprobs(tiny_model(), batch["tokens"], batch["mask"],
                          temperature=0.8, chunk=4)
  own = np.asarray(own) * batch["loss_mask"]
  on_policy = Learner(tiny_model(), step_config("learner"), mesh)
  metrics = on_policy.step(batch)
  assert metrics["ratio_deviation_max"] == 0.0
  assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
  for name in ("clip_low_frac", "clip_high_frac", "dual_clip_frac"):
    assert metrics[name] == 0.0, name
  tokens = batch["loss_mask"] > 0
  gap = np.abs(own - batch["old_logprobs"])[tokens]
  probs = np.abs(np.exp(own) - np.exp(batch["old_logprobs"]))[tokens]
  assert metrics["logprob_gap"] == pytest.approx(gap.mean(), rel=1e-5)
  # Maxima over both micro-batches, not their sum.
  assert metrics["logprob_gap_max"] == pytest.approx(gap.max(), rel=1e-5)
  assert metrics["rollout_probs_diff_mean"] == pytest.approx(probs.mean(),
                                                             rel=1e-4)
  assert metrics["rollout_probs_diff_max"] == pytest.approx(probs.max(),
                                                            rel=1e-4)

  # The sampler's log-probs as π_old clip here; the learner's own, taken
  # in a separate forward, give the same update as the stopped ones.
  off_policy = Learner(tiny_model(), step_config("sampler"), mesh)
  assert off_policy.step(batch)["ratio_deviation_max"] > 0.2
  verl = Learner(tiny_model(), step_config("sampler"), mesh)
  separate = verl.step(dict(batch, old_logprobs=own))
  assert separate["ratio_deviation_max"] < 1e-5
  # Adam divides by the gradient's scale: a ~1e-7 ratio difference moves
  # an element by ~1e-6 of a 1e-3 step.
  for a, b in zip(jax.tree.leaves(on_policy.params),
                  jax.tree.leaves(verl.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
  with pytest.raises(ValueError, match="old_logprobs='reference': must be one of"):
    GRPOLossConfig(old_logprobs="reference")


def test_weight_decay_reaches_the_optimizer():
  """AdamW's decoupled decay: with a zero gradient (zero advantages, no
  KL) one step scales every weight by exactly 1 - lr · weight_decay."""
  batch = dict(synthetic_batch(3), advantages=np.zeros(8, np.float32))
  model = tiny_model()
  before = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model,
                                                               nnx.Param)))
  learner = Learner(model, dataclasses.replace(
      config(kl_beta=0.0), optimizer=OptimizerConfig(
          learning_rate=0.1, weight_decay=0.5)), one_device_mesh())
  metrics = learner.step(batch)
  assert metrics["grad_norm"] == 0.0
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(learner.params)):
    np.testing.assert_allclose(np.asarray(b), a * (1 - 0.1 * 0.5), rtol=1e-6)


def test_grpo_learns_to_emit_a_target_token():
  """Reward = fraction of completion tokens equal to TARGET: the mean
  reward must rise clearly within a few dozen steps."""
  target, groups, rollouts, steps = 5, 4, 8, 30
  trainer = Learner(
      tiny_model(), TrainStepConfig(
          loss=GRPOLossConfig(kl_beta=0.0),
          optimizer=OptimizerConfig(learning_rate=3e-3),
          temperature=1.0, logprob_chunk=8), one_device_mesh())
  sampling = SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=6)
  sampler = Sampler(trainer.model, sampling, buckets=(8,))
  rng = np.random.default_rng(0)
  key = jax.random.key(0)
  history = []
  for _ in range(steps):
    prompts = [rng.integers(1, VOCAB, 5).tolist() for _ in range(groups)]
    key, sub = jax.random.split(key)
    nnx.update(sampler.model, nnx.state(trainer.model, nnx.Param))
    out = sampler([p for p in prompts for _ in range(rollouts)], sub)
    rewards = np.array([np.mean(np.asarray(c) == target) if c else 0.0
                        for c in out.completions()])
    history.append(rewards.mean())
    trainer.step(rollout_batch(out, group_advantages(
        rewards, np.ones_like(rewards), rollouts)))
  start, end = np.mean(history[:3]), np.mean(history[-3:])
  print(f"mean reward: first 3 steps {start:.3f}, last 3 steps {end:.3f}")
  assert start < 0.1
  assert end > 0.5, history


def test_supervised_batch_covers_only_response_tokens():
  batch = supervised_batch([[7, 8, 9], [4]], [[1, 2], [3, 5, 6]],
                           prompt_length=4, response_length=3, pad_id=0)
  np.testing.assert_array_equal(batch["tokens"], [[0, 7, 8, 9, 1, 2, 0],
                                                  [0, 0, 0, 4, 3, 5, 6]])
  np.testing.assert_array_equal(batch["mask"], [[0, 1, 1, 1, 1, 1, 0],
                                                [0, 0, 0, 1, 1, 1, 1]])
  np.testing.assert_array_equal(batch["loss_mask"], [[0, 0, 0, 0, 1, 1, 0],
                                                     [0, 0, 0, 0, 1, 1, 1]])
  np.testing.assert_array_equal(batch["token_weights"], batch["loss_mask"])
  with pytest.raises(ValueError, match="exceed 2 tokens"):
    supervised_batch([[1]], [[1, 2, 3]], 4, 2, 0)


def test_sft_loss_is_the_response_nll_and_falls_on_a_fixed_batch():
  rng = np.random.default_rng(0)
  prompts = [rng.integers(1, VOCAB, n).tolist() for n in (3, 5, 2, 4)]
  responses = [rng.integers(1, VOCAB, n).tolist() for n in (4, 2, 5, 3)]
  batch = supervised_batch(prompts, responses, 6, 5, 0)
  learner = Learner(tiny_model(), TrainStepConfig(
      loss=SFTLossConfig(), optimizer=OptimizerConfig(learning_rate=3e-3),
      micro_batches=2, logprob_chunk=4), one_device_mesh())
  assert learner.ref_params is None  # SFT needs no reference model.
  logp, _ = token_logprobs(learner.model, batch["tokens"], batch["mask"])
  want = -np.sum(np.asarray(logp) * batch["loss_mask"]) / sum(
      map(len, responses))
  losses = [learner.step(batch)["loss"] for _ in range(12)]
  assert losses[0] == pytest.approx(want, rel=1e-5)
  assert losses[-1] < 0.5 * losses[0], losses


def test_restore_params_takes_only_the_weights(tmp_path):
  first = Learner(tiny_model(), config(), one_device_mesh())
  _train(first, [0])
  ckpt = Checkpointer(str(tmp_path / "ckpt"))
  ckpt.save(1, first.params, first.opt_state, jax.random.key(0), {})
  # The save is asynchronous: a second Checkpointer sees only finished
  # steps (without this the read raced the write, seen once in CI).
  ckpt.wait()
  # Another objective and optimizer (no clipping: a different state tree).
  other = Learner(tiny_model(seed=3), TrainStepConfig(
      loss=SFTLossConfig(), optimizer=OptimizerConfig(grad_clip_norm=0.0)),
                  one_device_mesh())
  step, params = Checkpointer(str(tmp_path / "ckpt")).restore_params(
      other.params)
  assert step == 1
  for a, b in zip(jax.tree.leaves(jax.device_get(first.params)),
                  jax.tree.leaves(jax.device_get(params))):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(FileNotFoundError):
    Checkpointer(str(tmp_path / "empty")).restore_params(other.params)


def test_keep_period_keeps_every_kth_step_for_selection(tmp_path):
  """App. I evaluates the checkpoints of steps 20 and 50: with keep=2 and
  keep_period=10, steps 10, 20 survive beside the newest two, and any kept
  step loads by number."""
  learner = Learner(tiny_model(), config(kl_beta=0.0), one_device_mesh())
  ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=2, keep_period=10)
  saved = {}
  for step in (5, 10, 15, 20, 25):
    _train(learner, [step])
    ckpt.save(step, learner.params, learner.opt_state, jax.random.key(0), {})
    saved[step] = jax.device_get(learner.params)
  ckpt.wait()
  assert ckpt.steps() == [10, 20, 25]
  reader = Checkpointer(str(tmp_path / "ckpt"), read_only=True)
  step, params = reader.restore_params(learner.params, step=10)
  assert step == 10
  for a, b in zip(jax.tree.leaves(saved[10]),
                  jax.tree.leaves(jax.device_get(params))):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(FileNotFoundError, match="step 15"):
    reader.restore_params(learner.params, step=15)
  assert reader.steps() == [10, 20, 25]  # Reading deletes nothing.


def test_opening_a_directory_read_only_does_not_warn(tmp_path, caplog):
  """orbax warns that a read-only directory is read-only; we asked."""
  (tmp_path / "ckpt").mkdir()
  with caplog.at_level(logging.WARNING):
    Checkpointer(str(tmp_path / "ckpt"), read_only=True)
    absl_logging.warning("checkpoint %d in %s is unreadable", 3, "x")
  assert [r.getMessage() for r in caplog.records] == [
      "checkpoint 3 in x is unreadable"]  # Other warnings still show.


def test_a_non_finite_step_is_skipped_and_counted():
  trainer = Learner(tiny_model(), config(), one_device_mesh())
  _train(trainer, [0])
  params = jax.device_get(trainer.params)
  opt_state = jax.device_get(trainer.opt_state)
  poisoned = synthetic_batch(1)
  poisoned["advantages"] = np.full_like(poisoned["advantages"], np.nan)
  metrics = trainer.step(poisoned)
  assert not np.isfinite(metrics["loss"])
  assert metrics["update_skipped"] == 1.0
  assert metrics["skipped_updates_total"] == 1.0
  # Neither the weights nor Adam's moments / step count moved.
  for a, b in zip(jax.tree.leaves((params, opt_state)),
                  jax.tree.leaves(jax.device_get((trainer.params,
                                                  trainer.opt_state)))):
    np.testing.assert_array_equal(a, b)
  # The next finite step trains as if the bad one never happened.
  fresh = Learner(tiny_model(), config(), one_device_mesh())
  _train(fresh, [0, 2])
  metrics = trainer.step(synthetic_batch(2))
  assert metrics["update_skipped"] == 0.0
  assert metrics["skipped_updates_total"] == 1.0
  for a, b in zip(jax.tree.leaves(jax.device_get(fresh.params)),
                  jax.tree.leaves(jax.device_get(trainer.params))):
    np.testing.assert_allclose(a, b, atol=1e-6)


def test_an_update_that_overflows_the_weights_is_skipped_too(tmp_path):
  """Finite loss and gradients, but a learning rate that sends weights to
  inf: the step is skipped, so no checkpoint can hold a non-finite value;
  its metrics are logged as numbers (the non-finite ones named, not
  null)."""
  trainer = Learner(tiny_model(), TrainStepConfig(
      loss=GRPOLossConfig(kl_beta=0.0),
      optimizer=OptimizerConfig(learning_rate=1e39, grad_clip_norm=0.0)),
                    one_device_mesh())
  params = jax.device_get(trainer.params)
  metrics = trainer.step(synthetic_batch(0))
  assert np.isfinite(metrics["loss"]) and np.isfinite(metrics["grad_norm"])
  assert metrics["update_skipped"] == 1.0
  for a, b in zip(jax.tree.leaves(params),
                  jax.tree.leaves(jax.device_get(trainer.params))):
    np.testing.assert_array_equal(a, b)
  writer = MetricsWriter(str(tmp_path), tensorboard=False, progress=False)
  writer.write(1, {**metrics, "kl": float("nan")})
  writer.close()
  line = (tmp_path / "metrics.jsonl").read_text()
  assert "null" not in line and "NaN" not in line
  (record,) = read_metrics(str(tmp_path))
  assert "kl" in record["nonfinite"]
  assert all(math.isfinite(v) for v in record.values()
             if isinstance(v, float))
  assert record["update_skipped"] == 1.0


def test_splash_train_step_on_a_mesh_equals_the_xla_step():
  """The TPU attention path inside the real sharded step: splash (Pallas
  interpret mode here) under shard_map over fsdp × tensor, with remat and
  the KL reference, gives the per-head XLA step's loss, gradient norm and
  updated weights."""
  if len(jax.devices()) < 8:
    pytest.skip("needs the 8 fake CPU devices set up in conftest")
  results = {}
  for impl in ("per_head", "splash"):
    model = Qwen3(preset("tiny", vocab_size=VOCAB, attention_impl=impl,
                         remat="full"), rngs=nnx.Rngs(0))
    trainer = Learner(model, config(micro_batches=2, lr=4e-6),
                      make_mesh("fsdp:4,tensor:2"))
    results[impl] = (trainer.step(synthetic_batch(3)),
                     jax.device_get(trainer.params))
  (xla, xla_params), (splash, splash_params) = (results["per_head"],
                                                results["splash"])
  for key in ("loss", "kl", "grad_norm", "entropy"):
    np.testing.assert_allclose(splash[key], xla[key], rtol=1e-5, atol=1e-6)
  for a, b in zip(jax.tree.leaves(splash_params), jax.tree.leaves(xla_params)):
    np.testing.assert_allclose(a, b, atol=1e-5)


def test_the_update_holds_no_second_copy_of_the_state():
  """One step's temporaries beyond the resident state (params, reference,
  Adam moments) are the gradient plus activations, never a second params
  + optimizer state (selecting between whole new and old states to skip a
  non-finite update kept one alive). A model whose parameters dwarf the
  activations of a small batch: 4.0x the parameter bytes before, 2.8x
  now (the gradient, the tied embedding's second gradient term, one
  leaf's update at a time)."""
  model = Qwen3(preset("tiny", vocab_size=4096, hidden_size=128,
                       intermediate_size=512), rngs=nnx.Rngs(0))
  learner = Learner(model, config(), one_device_mesh())
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(learner.params))
  memory = learner.compiled(synthetic_batch(0)).memory_analysis()
  assert memory.temp_size_in_bytes < 3.3 * param_bytes, (
      memory.temp_size_in_bytes / param_bytes)


def test_the_heap_is_trimmed_once_per_compiled_step(monkeypatch):
  """Compiling the step frees hundreds of MB of small allocations that
  glibc would keep resident under the step's own buffers: the learner
  returns them after each compile (not after every step)."""
  import cmimem_jax.rl.trainer as trainer
  trims = []
  monkeypatch.setattr(trainer, "release_free_heap", lambda: trims.append(1))
  # A learning rate no other test uses: this test compiles its own step.
  learner = Learner(tiny_model(3), config(lr=7e-4), one_device_mesh())
  learner.step(synthetic_batch(0))
  learner.step(synthetic_batch(1))
  assert len(trims) == 1


class _DigitsTokenizer:
  """Token ids as text (`"5 17"`): what a `ChatPolicy` needs of a
  tokenizer when prompts are already token ids."""
  eos_token_id, pad_token_id = None, 0

  def decode(self, tokens, skip_special_tokens=True):
    del skip_special_tokens
    return " ".join(str(t) for t in tokens)


@pytest.mark.parametrize("learner_logprobs", [True, False])
def test_grpo_step_scores_with_the_reward_it_is_given(learner_logprobs):
  """`rl.GRPOStep`: G rollouts per prompt go to the reward passed in
  (texts and tokens), its rewards / gate / token weights / metrics /
  details reach the update and the result; a NaN reward is an invalid
  row, counted; the engine's KV buffers are freed before scoring, its
  weight copy (not its programs) before the update, and it gets the new
  weights after it. An engine whose log-probs are not
  the learner's has them recomputed: the JAX sampler's equal the
  learner's (gap ~0)."""
  from cmimem_jax.rl import GRPOStep, RolloutSettings, Scores
  from cmimem_jax.sampling import ChatPolicy
  learner = Learner(tiny_model(), config(), one_device_mesh())
  sampler = Sampler(learner.model, SamplingConfig(eos_ids=()), buckets=(8,))
  sampler.reports_learner_logprobs = learner_logprobs
  released, pushed = [], []
  release, set_model = sampler.release, sampler.set_model
  sampler.release = lambda **kwargs: (released.append(kwargs),
                                      release(**kwargs))
  sampler.set_model = lambda model: (pushed.append(model), set_model(model))
  policy = ChatPolicy(sampler, _DigitsTokenizer(), 8)
  step = GRPOStep(learner, policy, RolloutSettings(
      group=4, temperature=0.8, top_p=1.0, max_new_tokens=5,
      logprob_chunk=4))
  seen, batches = [], []
  learner_step = learner.step
  learner.step = lambda batch: (batches.append(batch), learner_step(batch))[1]

  def reward(rollouts):
    seen.append(rollouts)
    rewards = np.array([len(set(c)) for c in rollouts.completions], float)
    rewards[1] = np.nan
    weights = np.full((8, 5), 0.5, np.float32)
    return Scores(rewards, np.arange(8) != 6, weights, {"reward/distinct":
                                                        rewards.mean()}, "d")

  before = jax.device_get(learner.params)
  result = step([[5, 17, 33], [44, 8]], jax.random.key(0), reward)
  (rollouts,) = seen
  assert rollouts.group == 4 and len(rollouts.texts) == 8
  assert rollouts.texts[0] == " ".join(map(str, rollouts.completions[0]))
  np.testing.assert_array_equal(rollouts.output.prompt_tokens[3, -3:],
                                [5, 17, 33])
  metrics = result.metrics
  assert metrics["nonfinite_rewards"] == 1
  assert metrics["validity_rate"] == 6 / 8
  assert result.valid.tolist() == [True, False] + [True] * 4 + [False, True]
  assert np.isnan(metrics["reward/distinct"]) and result.scores.details == "d"
  assert result.rewards[1] == 0.0  # The NaN, replaced (and gated).
  (batch,) = batches
  np.testing.assert_array_equal(batch["advantages"], result.advantages)
  assert set(np.unique(batch["token_weights"])) <= {0.0, 0.5}
  assert released == [{}, {"programs": False, "weights": True}]
  assert len(pushed) == 1 and any(
      not np.array_equal(a, b) for a, b in zip(
          jax.tree.leaves(before), jax.tree.leaves(learner.params)))
  if learner_logprobs:
    assert "sampler_trainer_logprob_gap" not in metrics
  else:
    assert metrics["sampler_trainer_logprob_gap"] < 1e-5


class _WaveReward:
  """An `IncrementalReward` logging each `add` into the engine's `events`
  (its dispatches and releases); rewards: distinct tokens per row."""

  def __init__(self, needs_device, events):
    self.needs_device, self.events = needs_device, events

  def add(self, wave):
    assert len(wave.texts) == 4  # One group a wave.
    self.events.append("add")

  def finish(self, rollouts):
    from cmimem_jax.rl import Scores
    return Scores(np.array([len(set(c)) for c in rollouts.completions],
                           float))


@pytest.mark.parametrize("needs_device", [False, True])
def test_grpo_step_scores_each_wave_while_the_next_decodes(needs_device):
  """`GRPOStep` with `score_beside_decoding`: the reward gets each wave as
  it arrives, while the next decodes (dispatched before the `add`), or,
  when its `add` needs the device, with the KV buffers freed and before
  the next is dispatched; the samples, rewards and advantages are the
  serial order's (every wave decoded and the buffers freed, then
  scored)."""
  from cmimem_jax.rl import GRPOStep, RolloutSettings
  from cmimem_jax.sampling import ChatPolicy
  results, events = {}, {}
  for beside in (True, False):
    learner = Learner(tiny_model(), config(), one_device_mesh())
    sampler = Sampler(learner.model, SamplingConfig(eos_ids=()),
                      buckets=(8,), max_rows_per_wave=4)
    log = events.setdefault(beside, [])
    dispatch, release = sampler._dispatch_wave, sampler.release
    sampler._dispatch_wave = lambda *args: (log.append("dispatch"),
                                            dispatch(*args))[1]
    sampler.release = lambda **kwargs: (log.append("release"),
                                        release(**kwargs))[1]
    step = GRPOStep(learner, ChatPolicy(sampler, _DigitsTokenizer(), 8),
                    RolloutSettings(group=4, temperature=0.8, top_p=1.0,
                                    max_new_tokens=5, logprob_chunk=4,
                                    score_beside_decoding=beside))
    # The shapes of test_grpo_step_scores_with_the_reward_it_is_given's
    # update (its compiled program is loaded, not compiled again).
    results[beside] = step([[5, 17, 33], [44, 8]], jax.random.key(1),
                           _WaveReward(needs_device, log))
    assert results[beside].metrics["decode_waves"] == 2
  # The last two releases: the step's, then the update's.
  if needs_device:
    assert events[True] == ["dispatch", "release", "add"] * 2 + [
        "release"] * 2
  else:
    assert events[True] == ["dispatch"] * 2 + ["add"] * 2 + ["release"] * 2
  assert events[False] == ["dispatch"] * 2 + ["release"] + ["add"] * 2 + [
      "release"]
  serial, overlapped = results[False], results[True]
  for field in ("tokens", "logprobs", "lengths"):
    np.testing.assert_array_equal(getattr(overlapped.rollouts.output, field),
                                  getattr(serial.rollouts.output, field))
  assert overlapped.rollouts.texts == serial.rollouts.texts
  np.testing.assert_array_equal(overlapped.rewards, serial.rewards)
  np.testing.assert_array_equal(overlapped.advantages, serial.advantages)
  assert overlapped.metrics["loss"] == serial.metrics["loss"]
