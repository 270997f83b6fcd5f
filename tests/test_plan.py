"""tools/plan.py: AOT compile of the real Qwen3-4B-shaped programs from
abstract shapes, on the fake 8-device CPU mesh and for a TPU topology
(libtpu, from the test extras)."""

import importlib
import math
import os
import types

import jax
import pytest

from cmimem_jax.models.qwen3 import preset
from cmimem_jax.rl.step import GRPOStep, RolloutSettings
from cmimem_jax.task.curriculum import Curriculum, SessionRef
from cmimem_jax.task.qa_reward import QAConfig
from cmimem_jax.task.scoring_rounds import (call_rounds, endpoint_rounds,
                                            scoring_after_decoding)
from cmimem_jax.testing import run_tool
from tools import plan

ROOT = os.path.join(os.path.dirname(__file__), "..")
MEMORY_FIELDS = ("arguments_gib", "temporaries_gib", "outputs_gib",
                 "aliased_gib", "total_gib", "xla_tflops", "xla_bytes_accessed_gib",
                 "model_tflops", "model_bytes_gib")


@pytest.mark.slow
def test_plan_reports_memory_and_fit_for_a_sharded_mesh():
  if len(jax.devices()) < 8:
    pytest.skip("needs the 8 fake CPU devices set up in conftest")
  # 8 and 16 rows per device: a session's 8 rollouts share one prompt in
  # both (rl.share_prompts), so one program grows with the rows.
  rows = run_tool(plan, [f"--config={ROOT}/configs/qwen3_4b_tpu.py",
                         "--topology=cpu:8", "--programs=train",
                         "--mesh=fsdp:4,tensor:2", "--layers=1", "--length=256",
                         "--batch=8,16", "--budgets=16,32"])
  compiled, summary = rows[:2], rows[2]
  for row in compiled:
    assert row["arguments_gib"] > 0 and row["xla_tflops"] > 0
    assert row["attention_impl"] == "per_head" and "fits" not in row
  # More rows per device need more memory; the fit is affine.
  assert compiled[1]["total_gib"] > compiled[0]["total_gib"]
  assert summary["per_row_gib"] > 0
  # 1 layer of Qwen3-4B + embeddings, fp32 params and Adam moments, sharded
  # 8 ways: well under a GiB of arguments per device.
  assert compiled[0]["arguments_gib"] < 1.0
  # The LM head is vocabulary-parallel: no device holds the whole [V, H]
  # head in float32 (1.45 GiB), nor its gradient (3.0 GiB of temporaries
  # when every device gathered it, 0.93 since).
  qwen3_4b = preset("qwen3_4b")
  head_gib = qwen3_4b.vocab_size * qwen3_4b.hidden_size * 4 / plan.GIB
  assert compiled[0]["temporaries_gib"] < head_gib
  fits = summary["max_rows_per_chip"]
  assert fits["32GiB"] >= fits["16GiB"] >= 2


@pytest.mark.slow
def test_plan_compiles_the_train_step_and_rollout_for_a_v5p_8():
  pytest.importorskip("libtpu", reason="the TPU extra is not installed")
  # --run: the trainer's programs at the run's rows per chip (8 training
  # rows of each of 8 micro-batches; 2 sessions per chip a decoding wave;
  # the encoder's own batch), then the run's line per concurrency.
  *rows, run, run_32 = run_tool(plan, [
      f"--config={ROOT}/configs/qwen3_4b_tpu.py", "--topology=v5p-8",
      "--layers=1", "--length=128", "--completion=32", "--run",
      "--concurrency=8,32"])
  assert [(r["program"], r["rows_per_chip"]) for r in rows] == [
      ("train", 8), ("rollout", 2), ("encoder", 16)]
  for row in rows:
    assert row["device_kind"] == "TPU v5" and row["devices"] == 4
    assert row["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1}
    assert all(row[field] >= 0 for field in MEMORY_FIELDS)
    assert row["total_gib"] > 0 and row["xla_bytes_accessed_gib"] > 0
    assert row["hbm_gib"] == 95 and row["fits"] is True
    assert row["bound"] in ("compute", "memory") and row["roofline_s"] > 0
  train, rollout, encoder = rows
  # The whole step's update: 8 micro-batches x 8 rows x 4 chips.
  assert train["micro_batches"] == 8 and train["global_batch"] == 256
  # The Sampler's program decodes on every chip (configs/qwen3_4b_tpu.py:
  # rollout.decode_devices="mesh"), 2 sessions x 8 rollouts per chip, and
  # the learner's optimizer state and reference stay resident beside it.
  assert rollout["decode_devices"] == "mesh"
  assert rollout["decoding_chips"] == 4 and rollout["global_batch"] == 8
  assert rollout["rollouts_per_prompt"] == 8
  assert rollout["with_resident_gib"] == pytest.approx(
      rollout["total_gib"] + rollout["resident_gib"], abs=2e-3)
  # With one layer XLA counts every FLOP of one micro-batch (the scan
  # over micro-batches it counts once): the model's own count agrees.
  assert 0.9 < train["model_tflops"] / train["xla_tflops"] < 1.1
  assert train["attention_impl"] == rollout["attention_impl"] == "splash"
  # 5 passes over the RL split's 50 dialogues x 48 sessions, 32 a step.
  assert run["program"] == "run" and run["steps"] == math.ceil(
      5 * 50 * 48 / 32) == 375
  assert run["hours"] > 0 and run["chips"] == 4
  # Each rounded to 3 decimals: hours' rounding, times 4, plus its own.
  assert run["chip_hours"] == pytest.approx(run["hours"] * 4, abs=2.5e-3)
  assert run["fits"] == {"train": True, "rollout": True, "encoder": True}
  # The in-process Qwen3-Embedding (configs/qwen3_4b_tpu.py's encoder):
  # its largest call, 16 texts x 8,192 tokens on one chip, beside the
  # learner's whole state (more resident than beside a rollout, whose
  # weights are its own arguments).
  assert encoder["global_batch"] == 16 and encoder["length"] == 8192
  assert encoder["resident_gib"] > rollout["resident_gib"] > 0
  per_step = run["per_step"]

  def roofline(row):  # v5p: 459 TFLOP/s, 2765 GB/s.
    return max(row["model_tflops"] / 459,
               row["model_bytes_gib"] * plan.GIB / 2765e9)

  # The programs' roofline seconds, times their calls in a step: 8
  # micro-batches, each session's prompt once for its 8 rollouts
  # (rl.share_prompts: the compiled update is the shared one, packed for
  # the splash kernel, whose padded columns the model counts as XLA does
  # above); 4 waves of a prefill and 32 decoded tokens.
  assert run["prompt_group"] == train["prompt_group"] == 8
  assert per_step["train_s"] == pytest.approx(8 * roofline(train), rel=1e-2)
  assert per_step["rollout_prefill_s"] == pytest.approx(
      4 * rollout["rollout_prefill_roofline_s"], rel=1e-2)
  assert per_step["rollout_decode_s"] == pytest.approx(
      4 * 32 * rollout["rollout_decode_roofline_s"], rel=1e-2)
  # The whole program: its prefill and its 32 steps.
  assert rollout["roofline_s"] == pytest.approx(
      rollout["rollout_prefill_roofline_s"]
      + 32 * rollout["rollout_decode_roofline_s"], rel=2e-2)
  # 256 rollouts x 5 questions at 8 calls in flight, the last verdicts a
  # round later, 3 s a round; each of the 4 waves' 320 calls sent as it is
  # decoded, so the first's outlast the decoding of the 3 after it
  # (these 1-layer, 32-token waves take milliseconds); the learner's own
  # log-probs.
  wave_s = (per_step["rollout_prefill_s"] + per_step["rollout_decode_s"]) / 4
  assert run["endpoint"]["scoring_s"] == (1280 / 8 + 1) * 3.0
  assert per_step["reward_endpoint_s"] == pytest.approx(
      scoring_after_decoding([320] * 4, 8, 3.0, wave_s), abs=1e-5)
  assert per_step["reward_endpoint_s"] == pytest.approx(
      (1280 / 8 + 1) * 3.0 - 3 * wave_s, abs=1e-5)
  assert run["endpoint"]["answer_concurrency"] == 8
  assert run["endpoint"]["call_latency_s"] == 3.0
  assert "in flight together" in run["endpoint"]["overlap"]
  assert "while the next waves decode" in run["endpoint"]["overlap"]
  assert run_32["endpoint"]["scoring_s"] == (1280 / 32 + 1) * 3.0
  assert run_32["endpoint"]["judge_concurrency"] == 32
  assert 0 < per_step["reward_host_s"] < 256 * 0.05
  assert per_step["recompute_logprobs_s"] == 0
  assert run["step_s"] == pytest.approx(sum(per_step.values()), abs=1e-2)
  assert set(run["assumptions"]) == {*per_step, "steps", "step_s", "hours",
                                     "chip_hours"}
  assert "459" in run["assumptions"]["hours"]
  with pytest.raises(SystemExit, match="v5p-8"):
    run_tool(plan, [f"--config={ROOT}/configs/qwen3_4b_tpu.py",
                    "--topology=v7x-8"])


def test_plan_takes_the_architecture_of_a_checkpoint(tmp_path):
  """--checkpoint: the rehearsal's stand-in policy (a random Qwen3 of its
  own config.json) at the 4B config's dtype and remat, not the preset."""
  from cmimem_jax.testing import standins
  from flax import nnx
  from cmimem_jax.models.qwen3 import Qwen3Config
  from cmimem_jax.models.qwen3.params import abstract_model
  tokenizer = standins.make_tokenizer(str(tmp_path / "tokenizer"),
                                      standins.corpus())
  path = standins.make_policy_checkpoint(str(tmp_path / "policy"), tokenizer)
  (row,) = run_tool(plan, [f"--config={ROOT}/configs/qwen3_4b_tpu.py",
                           "--topology=cpu:1", f"--checkpoint={path}",
                           "--programs=train", "--length=64", "--completion=8"])
  config = Qwen3Config.from_pretrained(path)
  params = sum(x.size for x in jax.tree.leaves(
      nnx.state(abstract_model(config), nnx.Param)))
  assert row["layers"] == config.num_hidden_layers == 2
  # Parameters, the reference and two AdamW moments in float32, plus one
  # row of 64 tokens: the stand-in's ~2 MB (the row rounds GiB to 3
  # decimals), not Qwen3-4B's 60 GiB.
  assert abs(row["arguments_gib"] - 4 * 4 * params / plan.GIB) < 6e-4
  with pytest.raises(SystemExit, match="give one"):
    run_tool(plan, [f"--config={ROOT}/configs/qwen3_4b_tpu.py",
                    "--topology=cpu:1", f"--checkpoint={path}",
                    "--preset=smollm2_135m"])
  with pytest.raises(SystemExit, match="no config.json there"):
    run_tool(plan, [f"--config={ROOT}/configs/qwen3_4b_tpu.py",
                    "--topology=cpu:1",
                    f"--checkpoint={tmp_path / 'tokenizer'}"])


def test_plan_compiles_the_cmi_kernel_for_a_v5p_8():
  pytest.importorskip("libtpu", reason="the TPU extra is not installed")
  (row,) = run_tool(plan, [f"--config={ROOT}/configs/qwen3_4b_tpu.py",
                           "--topology=v5p-8", "--programs=cmi_kernel",
                           "--batch=16", "--cmi_shape=8,128"])
  assert row["program"] == "cmi_kernel" and row["cmi_shape"] == [8, 128]
  assert row["global_batch"] == 16 * row["devices"]
  assert row["total_gib"] > 0 and row["fits"] is True
  assert row["bound"] in ("compute", "memory")
  assert "layers" not in row and "length" not in row


# --- the whole run (--run): the arithmetic, without compiling ----------------

SHAPE = plan.RunShape(
    sessions=100, epochs=3, sessions_per_step=8, max_steps=0, rollouts=4,
    micro_batches=2, completion_tokens=10, waves=2, questions=2,
    concurrency=4, call_latency_s=0.5, chips=4, host_s=0.75)
SECONDS = {"rollout_prefill": 1.0, "rollout_decode": 0.1, "train": 5.0,
           "recompute": 0.25, "cmi_kernel": 0.5}


def test_run_cost_adds_every_stage_of_every_step():
  run = plan.run_cost(SHAPE, SECONDS)
  # ceil(3 x 100 / 8): the last batch runs into a fourth pass.
  assert run["steps"] == 38
  # 2 waves of 4 sessions x 4 rollouts x 2 questions = 32 calls each, 4
  # in flight: 9 rounds each (8 + the last verdicts), 17 for both. A wave
  # decodes in 1 + 10 x 0.1 = 2 s, so wave 1's calls outlast it by
  # 17 x 0.5 - 2 = 6.5 s (wave 2's alone: 4.5 s); the old log-probs'
  # recompute (0.5 s) runs beside them.
  assert SHAPE.wave_calls() == [32, 32]
  assert run["per_step"] == {
      "rollout_prefill_s": 2 * 1.0,             # waves x a wave's prefill
      "rollout_decode_s": 2 * 10 * 0.1,         # waves x tokens x a token
      "reward_cmi_s": 0.5,
      "reward_endpoint_s": 17 * 0.5 - 2.0 - 0.5,
      "reward_host_s": 0.75,
      "recompute_logprobs_s": 2 * 0.25,         # micro-batches x a forward
      "train_s": 2 * 5.0}                       # micro-batches x a call
  assert run["endpoint_s"] == 17 * 0.5 and run["endpoint_hidden_s"] == 2.5
  assert run["step_s"] == 21.75
  assert run["hours"] == round(38 * 21.75 / 3600, 3)
  assert run["chip_hours"] == round(38 * 21.75 / 3600 * 4, 3)
  # max_steps overrides the passes.
  capped = plan.run_cost(plan.dataclasses.replace(SHAPE, max_steps=5),
                         SECONDS)
  assert capped["steps"] == 5 and capped["step_s"] == run["step_s"]
  # Scored after the last wave: every round after the decoding.
  serial = plan.run_cost(plan.dataclasses.replace(
      SHAPE, score_beside_decoding=False), SECONDS)
  assert serial["per_step"]["reward_endpoint_s"] == 17 * 0.5 - 0.5
  # A last wave holds the sessions left over.
  assert plan.dataclasses.replace(SHAPE, waves=3).wave_calls() == [
      24, 24, 16]


def _simulated_scoring(wave_calls, concurrency, latency, wave_s):
  """What `scoring_after_decoding` models, simulated call by call: wave
  w's calls sent at (w + 1) x wave_s into an answer pool of
  `concurrency` workers, each verdict into a judge pool of as many as
  its answer arrives; seconds from the last wave to the last verdict."""
  import heapq

  def serve(arrivals):
    workers, done = [0.0] * concurrency, []
    for arrival in sorted(arrivals):
      start = max(arrival, heapq.heappop(workers))
      heapq.heappush(workers, start + latency)
      done.append(start + latency)
    return done
  arrivals = [(w + 1) * wave_s for w, n in enumerate(wave_calls)
              for _ in range(n)]
  verdicts = serve(serve(arrivals))
  return max(verdicts, default=0.0) - len(wave_calls) * wave_s if (
      verdicts) else 0.0


@pytest.mark.parametrize("wave_calls,concurrency,wave_s", [
    ([10, 10, 10], 10, 5.0),    # Each wave's calls end within the next.
    ([10, 10, 10], 10, 0.1),    # A backlog: the first wave's calls show.
    ([320] * 4, 32, 62.0),      # The paper's v5p-8 step at 32 in flight.
    ([320] * 4, 8, 62.0),
    ([7, 0, 12, 3], 4, 1.3),
    ([0, 0], 4, 1.0)])
def test_scoring_after_decoding_is_the_simulated_step(wave_calls,
                                                      concurrency, wave_s):
  model = scoring_after_decoding(wave_calls, concurrency, 3.0, wave_s)
  assert model == pytest.approx(
      _simulated_scoring(wave_calls, concurrency, 3.0, wave_s), abs=1e-9)
  serial = scoring_after_decoding(wave_calls, concurrency, 3.0, wave_s,
                                  beside=False)
  assert serial == call_rounds(sum(wave_calls), concurrency) * 3.0
  assert model <= serial


@pytest.mark.parametrize("sessions,batch,epochs", [(100, 8, 3), (2400, 32, 5),
                                                   (7, 3, 1), (96, 32, 2)])
def test_run_steps_are_the_curricula(sessions, batch, epochs):
  refs = [SessionRef(0, i, float(i)) for i in range(sessions)]
  shape = plan.dataclasses.replace(SHAPE, sessions=sessions,
                                   sessions_per_step=batch, epochs=epochs)
  assert shape.steps == Curriculum(refs, batch, 3, epochs).planned_steps


def _config(name: str, **rl):
  config = importlib.import_module(
      f"configs.{name.removesuffix('.py')}").get_config()
  config.rl.update(rl)
  return config


def test_run_layout_sessions_and_endpoint_rounds_of_the_paper_configs():
  tpu, h20 = _config("qwen3_4b_tpu.py"), _config("qwen3_4b_h20_vllm.py")
  # 32 sessions x 8 rollouts, 8 micro-batches on the TPU (32 on the
  # H20s); the TPU decodes 64 rows (8 sessions) a wave on its 4 chips,
  # vLLM every row at once.
  assert plan.run_layout(tpu, 4, 4) == {"train": 8, "rollout": 2,
                                        "waves": 4}
  assert plan.run_layout(h20, 8, 8) == {"train": 1, "rollout": 4, "waves": 1}
  # Shares that do not divide round up; decoding on one device, it holds
  # the whole wave; a wave of 64 rows over 32 chips is 256 rows (a group
  # on each chip).
  assert plan.run_layout(tpu, 3, 1)["train"] == 11
  assert plan.run_layout(tpu, 4, 1) == {"train": 8, "rollout": 8,
                                        "waves": 4}
  assert plan.run_layout(tpu, 32, 32) == {"train": 1, "rollout": 1,
                                          "waves": 1}
  # The RL split's 50 dialogues x 48 sessions (Table 5: ~2,400), less the
  # held-out ones; --sessions replaces the count.
  assert plan.run_sessions(tpu, 0)[0] == 2400
  assert plan.run_sessions(_config("qwen3_4b.py", validation_sessions=100),
                           0)[0] == 2300
  assert plan.run_sessions(tpu, 640) == (640, "--sessions=640")
  with pytest.raises(SystemExit, match="--sessions"):
    plan.run_sessions(_config("default.py"), 0)
  # 256 rollouts x 5 questions, 8 in flight, the last verdicts a round
  # later; the slower endpoint decides; --concurrency sets both.
  assert endpoint_rounds(QAConfig.from_config(tpu.qa), 256, 5) == 160 + 1
  tpu.qa.answer.concurrency = 2
  tpu_qa = QAConfig.from_config(tpu.qa)
  assert endpoint_rounds(tpu_qa, 256, 5) == 640 + 1
  assert endpoint_rounds(tpu_qa, 256, 5, concurrency=32) == 40 + 1
  assert endpoint_rounds(QAConfig.from_config(_config("tiny.py").qa),
                         256, 5) == 0
  # The learner's rows per shared prompt (what the plan costs the update
  # with): a session's 8 rollouts split into micro-batches x chips
  # (rl.shared_prompt_group's rule).
  def prompt_group(micro_batches, share=True):
    learner = types.SimpleNamespace(shards=4, config=types.SimpleNamespace(
        share_prompts=share, micro_batches=micro_batches))
    return GRPOStep(learner, None, RolloutSettings(
        8, 0.8, 0.9, 32)).update_prompt_group(256)
  assert prompt_group(8) == 8
  assert prompt_group(32) == 2
  assert prompt_group(8, share=False) == 1


def test_shared_train_cost_counts_each_prompt_once():
  c = preset("qwen3_4b")
  whole = plan.step_cost(c, "train", 8, 26000, 6000, 5, 1)
  shared = plan.shared_train_cost(c, 8, 26000, 6000, 5, 8)
  assert plan.shared_train_cost(c, 8, 26000, 6000, 5, 1) == whole
  assert shared[1] == whole[1]  # The same weights read per pass.
  # 20k-token prompts, 6k-token responses: about 0.4 of the FLOPs.
  assert 0.35 < shared[0] / whole[0] < 0.45


def test_host_seconds_measures_the_attribution_weights():
  seconds, how = plan.host_seconds(4, 2000)
  assert 0 < seconds < 4 * 0.05 and "4 rollouts" in how


def test_host_chip_measures_this_machine():
  chip = plan.host_chip("float32")
  assert chip.peak_bf16_tflops > 0 and chip.hbm_gbytes_per_s > 0
  assert chip.hbm_gib > 1 and chip.source.startswith("measured on this host")


# --- the plan's programs are the trainer's ------------------------------------


@pytest.mark.slow
def test_the_trainer_decodes_on_the_mesh_and_the_plan_lowers_its_programs(
    tmp_path, monkeypatch):
  """configs/tiny.py decoding on the mesh of the 8 fake devices
  (`rollout.decode_devices="mesh"`, data:2 x fsdp:2 x tensor:2): the
  trainer's sampler splits every KV cache leaf over the 4 batch shards and
  samples the tokens / log-probs of one-device decoding; the generation
  program and the update that `plan.trainer_step` lowers from abstract
  weights are the very programs of the `Trainer`'s own step
  (`Trainer.grpo`, over its real weights): equal StableHLO text."""
  import hashlib

  import numpy as np
  import test_train
  from cmimem_jax.parallel import BATCH_AXES
  from cmimem_jax.sampling import Sampler
  from cmimem_jax.task.loop import Trainer
  overrides = {"mesh": "data:2,fsdp:2,tensor:2",
               "rollout.decode_devices": "mesh"}
  config = test_train.tiny_config(**overrides)
  # The step's programs, not the start-up's snapshots.
  monkeypatch.setattr(Trainer, "_snapshots", lambda self, version: {})
  trainer = Trainer(config, str(tmp_path))
  engine = trainer.policy.engine
  assert engine.row_shards == 4
  rollout = config.rollout
  rows = [[11 + p] * (5 + p) for p in range(3) for _ in range(4)]
  key = jax.random.key(1)
  got = trainer.policy.generate(rows, key, 1.0, 0.9, 8)
  one = Sampler(trainer.learner.model, engine.config, engine.buckets,
                mesh=trainer.mesh)
  want = one.generate(rows, key, 1.0, 0.9, 8)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)
  for leaf in jax.tree.leaves(list(engine._caches.values())):
    assert BATCH_AXES in leaf.sharding.spec
    assert leaf.addressable_shards[0].data.nbytes * 4 <= leaf.nbytes
  prompt, new = max(rollout.buckets), rollout.max_new_tokens
  sessions = config.rl.sessions_per_batch
  theirs = {"rollout": trainer.grpo.lower_rollout(sessions, prompt),
            "train": trainer.grpo.lower_update(
                sessions * rollout.num_rollouts, prompt)}
  step, _, notes = plan.trainer_step(config, trainer.mesh)
  assert notes == {"tokenizer": "the config's"}
  # One wave of 3 sessions (padded to a prompt per batch shard) and 12
  # training rows (3 per shard, one micro-batch).
  ours = {name: plan.lower_program(step, name, 1 if name == "rollout" else 3,
                                   prompt + new, new)
          for name in ("rollout", "train")}
  for name in theirs:
    fingerprint = lambda lowered: hashlib.sha256(  # noqa: E731
        lowered.as_text().encode()).hexdigest()
    assert fingerprint(ours[name]) == fingerprint(theirs[name]), name
