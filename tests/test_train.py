"""`python -m cmimem_jax.train` end to end with configs/tiny.py."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from cmimem_jax.cmi.logprob import profile_messages
from cmimem_jax.config import ConfigError, apply_overrides
from cmimem_jax.evaluation.answering import MemoryContext
from cmimem_jax.evaluation.judges import context_recall
from cmimem_jax.memory.dsl import parse
from cmimem_jax.rl import read_metrics, read_rollouts
from cmimem_jax.sampling import EngineHooks
from cmimem_jax.sampling.sampler import SampleOutput, bucket_length, left_pad
from cmimem_jax.task.episode import apply_to_copy
from cmimem_jax.task.loop import (RLConfig, Trainer, plan_sessions,
                                  training_dialogues)
from cmimem_jax.task.reward import RewardComputer, RewardConfig, RolloutInput
from cmimem_jax.task.skip_table import calibrated
from configs import tiny
from tools import skip_report

pytestmark = pytest.mark.slow
ROOT = os.path.join(os.path.dirname(__file__), "..")


def tiny_config(**overrides):
  config = tiny.get_config()
  config.mesh = "fsdp:2,tensor:4"  # The 8 fake CPU devices of conftest.
  config.tensorboard = False
  return apply_overrides(config, overrides)


VALIDATION = {"rl.validation_sessions": 2, "rl.eval_every": 2}
# Scripted engines pad prompts to the run's buckets: the same compiled
# train step as a real run of the config.
TINY_BUCKETS = tuple(tiny_config().rollout.buckets)


RESPONSES = [
    "CORE:APPEND|Adopted a rescue greyhound named Biscuit; works from home "
    "on Mondays and Fridays.\nEPISODIC:ADD|2024-03-02: adopted Biscuit, who "
    "is scared of stairs\nSEMANTIC:ADD|Greyhounds - ex-racers often need "
    "stair training\nPROCEDURAL:SKIP",
    "not a DSL response at all",
    "CORE:APPEND|Training for the Lisbon half marathon.\nEPISODIC:ADD|"
    "2024-01-08: started a 16-week half marathon plan\nSEMANTIC:SKIP\n"
    "PROCEDURAL:ADD|How to build mileage: 1. add 10 % per week 2. one long "
    "run",
    "CORE:APPEND|Learning European Portuguese.\nEPISODIC:SKIP\n"
    "SEMANTIC:SKIP\nPROCEDURAL:SKIP",
]


class ScriptedEngine(EngineHooks):
  """A `GenerationEngine` returning RESPONSES cyclically (for every row)."""

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer
    self.prompts = []  # Every prompt row asked for, in order.

  def set_model(self, model):
    del model

  def generate(self, prompts, key, temperature, top_p, max_new_tokens,
               row_budgets=None, constrained=True):
    del key, temperature, top_p, max_new_tokens, row_budgets, constrained
    self.prompts += [list(p) for p in prompts]
    tokenizer = self.tokenizer
    length = bucket_length(max(len(p) for p in prompts), TINY_BUCKETS)
    prompt_tokens, prompt_mask = left_pad(prompts, length, 0)
    texts = [RESPONSES[i % len(RESPONSES)] for i in range(len(prompts))]
    encoded = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    width = max(len(e) for e in encoded)
    tokens = np.zeros((len(prompts), width), np.int32)
    for row, ids in enumerate(encoded):
      tokens[row, :len(ids)] = ids
    return SampleOutput(tokens, np.zeros(tokens.shape, np.float32),
                        np.array([len(e) for e in encoded]), prompt_tokens,
                        prompt_mask)


def test_logged_reward_terms_equal_direct_computation(tmp_path):
  config = tiny_config(**{"rl.max_steps": 1, "reward.alpha": 0.5,
                           "rl.log_rollouts": True, "rl.weight_decay": 0.05})
  loop = Trainer(config, str(tmp_path))
  # The rl section reaches the optimizer (its effect: test_trainer's
  # test_weight_decay_reaches_the_optimizer).
  assert loop.learner.config.optimizer.weight_decay == 0.05
  loop.policy.engine = ScriptedEngine(loop.policy.tokenizer)
  batches = []
  learner_step = loop.learner.step
  loop.learner.step = lambda batch: (batches.append(batch),
                                     learner_step(batch))[1]
  metrics = loop.step()

  # Directly: parse each response, apply it to the session's snapshot,
  # score the session's QA pairs with context recall on M_t, then the CMI
  # reward module on the same inputs.
  episodes = [loop.episode(r) for r in loop.curriculum.batch(0)]
  group = config.rollout.num_rollouts
  # The rollouts' prompts are the one policy prompt (`loop.prompter`, as
  # evaluation's: tests/task/test_policy_prompt.py), each once per rollout.
  assert loop.policy.engine.prompts == [
      loop.policy.encode(loop.prompter(e.bank, e.session))
      for e in episodes for _ in range(group)]
  rollouts = []
  for row in range(len(episodes) * group):
    episode = episodes[row // group]
    text = loop.policy.decode(loop.policy.tokenizer.encode(
        RESPONSES[row % len(RESPONSES)], add_special_tokens=False))
    response = parse(text)
    qa, counts = 0.0, None
    if response.valid:
      after = apply_to_copy(episode.bank, episode.session, response,
                            loop.encoder, loop.memory)
      provider = MemoryContext(after, episode.dialogue, loop.encoder,
                               config.qa.top_k)
      contexts = [provider(q) for q in episode.questions]
      qa = np.mean([context_recall(q, c.context)
                    for q, c in zip(episode.questions, contexts)])
      types = {e.entry_id: e.memory_type for e in after.entries()}
      counts = {}
      for c in contexts:
        for i in c.retrieved:
          counts[types[i]] = counts.get(types[i], 0) + 1
    rollouts.append(RolloutInput(episode.bank, episode.session.format(),
                                 response, float(qa), counts))
  terms = RewardComputer(loop.encoder, calibrated(RewardConfig.from_config(
      config.reward), config.encoder))(rollouts)
  for name in ("cmi", "qa", "total", "reward", "length_factor",
               "intra_duplicate_factor", "semantic_skip_bonus"):
    want = np.mean([getattr(t, name) for t in terms])
    assert metrics[f"reward/{name}"] == pytest.approx(want, abs=1e-9), name
  assert metrics["validity_rate"] == pytest.approx(0.75)
  # The rollouts.jsonl records (`rl.log_rollouts`): each rollout's own terms.
  records = loop.rollout_records
  assert [r["reward"] for r in records] == pytest.approx(
      [t.reward for t in terms], abs=1e-9)
  assert [r["response"] for r in records] == [
      loop.policy.decode(loop.policy.tokenizer.encode(
          RESPONSES[row % len(RESPONSES)], add_special_tokens=False))
      for row in range(len(records))]
  assert [r["session"] for r in records] == [
      s for s in metrics["sessions"] for _ in range(group)]
  skips = [r for r in records if r["semantic_skip"]]
  assert skips and all(isinstance(r["semantic_skip_statement_cosines"],
                                  tuple)
                       and r["semantic_skip_justified"] in (0.0, 1.0)
                       for r in skips)
  assert metrics["reward/qa"] > 0 and metrics["reward/cmi"] != 0
  # Composite reward with alpha = 0.5 before the multiplicative factors.
  assert np.mean([t.base for t in terms]) == pytest.approx(
      np.mean([0.5 * t.cmi + 0.5 * t.qa for t in terms]))
  # Attribution reached the loss: in rollouts with a dominant memory type
  # (App. D) that type's line weighs more; every other completion token 1.
  assert metrics["advantage_abs_max"] > 0
  weights, loss_mask = batches[0]["token_weights"], batches[0]["loss_mask"]
  for row, term in enumerate(terms):
    row_weights = weights[row][loss_mask[row] > 0]
    if term.dominant_type is None:
      assert set(row_weights.tolist()) == {1.0}
    else:
      assert row_weights.max() > 1.0 and row_weights.min() == 1.0


def test_bad_training_config_is_reported_before_work(tmp_path):
  config = tiny_config(**{"rollout.num_rollouts": 3, "rl.curriculum_tiers": 4})
  with pytest.raises(ConfigError) as error:
    Trainer(config, str(tmp_path))
  message = str(error.value)
  assert "must be >= rl.curriculum_tiers=4" in message
  assert "must divide into rl.micro_batches=1 x 2 data shards" in message


def test_an_encoder_without_a_skip_calibration_refuses_to_train(tmp_path):
  """The Semantic SKIP thresholds are the encoder's own: with none in the
  calibration table, training stops before anything loads, naming the
  tool that makes them."""
  config = tiny_config(**{"encoder.dim": 48})
  with pytest.raises(ConfigError, match="no Semantic SKIP calibration for "
                     "encoder .*'dim': 48.*tools.skip_calibration"):
    Trainer(config, str(tmp_path))
  assert not os.path.exists(tmp_path / "checkpoints")


def test_crash_between_checkpoints_then_resume_with_a_snapshot_refresh(
    tmp_path):
  """Killed after step 3 with the last checkpoint at 2: the resumed run
  redoes step 3 from the same state and curriculum position, logs every
  step once, and refreshes the snapshots at the epoch boundary. Also the
  validation curve: two held-out sessions, never in a training batch,
  scored every 2 steps and at the last."""
  overrides = {**VALIDATION, "rl.max_steps": 4, "checkpoint.every_steps": 2,
               "rl.sessions_per_batch": 5, "rl.log_rollouts": True}
  first = Trainer(tiny_config(**overrides), str(tmp_path))
  assert first.resumed_from is None
  held_out = {(r.dialogue, r.session) for r in first.validation}
  assert len(held_out) == 2
  assert not held_out & {(r.dialogue, r.session)
                         for step in range(first.curriculum.planned_steps)
                         for r in first.curriculum.batch(step)}
  # Epoch 1 starts at step 4 (index 3).
  assert (first.curriculum.epoch(2), first.curriculum.epoch(3)) == (0, 1)
  step = first.step

  def killed_at_step_4():
    if first.loop.step == 3:
      raise RuntimeError("killed")
    return step()

  first.step = killed_at_step_4
  with pytest.raises(RuntimeError, match="killed"):
    first.run()
  crashed = read_metrics(str(tmp_path))
  assert [m["step"] for m in crashed] == [1, 2, 3]
  for m in crashed:
    assert np.isfinite(m["loss"]) and "reward/cmi" in m and "kl" in m
    # The JAX sampler's rollouts, on-policy old log-probs: ratio 1 on
    # every token; the sampler/learner gap is logged.
    assert m["ratio_deviation_max"] == 0.0
    assert 0 <= m["logprob_gap"] <= m["logprob_gap_max"] < 1e-3
    assert len(m["sessions"]) == 5
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2"]
  assert [m["snapshot_version"] for m in crashed] == [0, 0, 0]
  rows_per_step = 5 * first.group
  assert [r["step"] for r in read_rollouts(str(tmp_path))] == [
      step for step in (1, 2, 3) for _ in range(rows_per_step)]

  resumed = Trainer(tiny_config(**overrides), str(tmp_path))
  assert resumed.resumed_from == 2 and resumed.loop.step == 2
  assert resumed.validation == first.validation
  resumed.run()
  metrics = read_metrics(str(tmp_path))
  assert [m["step"] for m in metrics] == [1, 2, 3, 4]
  assert [m["snapshot_version"] for m in metrics] == [0, 0, 0, 1]
  # Step 3's rollouts logged once, from the resumed run.
  rollouts = read_rollouts(str(tmp_path))
  assert [r["step"] for r in rollouts] == [
      step for step in (1, 2, 3, 4) for _ in range(rows_per_step)]
  assert [r["session"] for r in rollouts] == [
      s for m in metrics for s in m["sessions"] for _ in range(first.group)]
  assert [r["reward"] for r in rollouts[-rows_per_step:]] == pytest.approx(
      [r["reward"] for r in resumed.rollout_records])
  # tools/skip_report.py reads the run: every rollout counted once.
  counts = skip_report.skip_counts(rollouts, skip_report.run_kinds(
      str(tmp_path)))
  assert sum(c["rollouts"] for c in counts.values()) == len(rollouts)
  assert sum(c["skips"] for c in counts.values()) == sum(
      bool(r["semantic_skip"]) for r in rollouts)
  assert sorted(os.listdir(tmp_path / "snapshots")) == ["v0", "v1"]
  assert ["eval/reward" in m for m in metrics] == [False, True, False, True]
  assert all(m["eval/sessions"] == 2 for m in metrics[1::2])
  names = {f"{resumed.dialogues[d].dialogue_id}/{t}" for d, t in held_out}
  assert not names & {s for m in metrics for s in m["sessions"]}
  # Step 3 again, from checkpoint 2's weights, RNG and curriculum position
  # (the curriculum's batch 2).
  assert metrics[2]["sessions"] == crashed[2]["sessions"] == [
      f"{resumed.dialogues[r.dialogue].dialogue_id}/{r.session}"
      for r in resumed.curriculum.batch(2)]
  for key in ("reward_mean", "validity_rate", "loss"):
    assert metrics[2][key] == pytest.approx(crashed[2][key], abs=1e-5), key


class ScoresNaNOnce:
  """The QA reward, returning NaN for its first valid rollout."""

  def __init__(self, qa):
    self.qa, self.failures, self.calls = qa, qa.failures, 0

  def submit(self, bank, episode):
    self.calls += 1
    pending, first = self.qa.submit(bank, episode), self.calls == 1

    class Pending:
      def wait(self):
        score, counts = pending.wait()
        return (float("nan") if first else score), counts
    return Pending()


def test_a_non_finite_reward_is_an_invalid_rollout_not_a_crash(tmp_path):
  loop = Trainer(tiny_config(**{"rl.max_steps": 1}), str(tmp_path))
  loop.policy.engine = ScriptedEngine(loop.policy.tokenizer)
  loop.qa = ScoresNaNOnce(loop.qa)
  metrics = loop.step()
  rows = len(metrics["sessions"]) * loop.group
  assert metrics["nonfinite_rewards"] == 1
  # 3 of every 4 scripted responses are valid; the NaN one no longer is.
  assert metrics["validity_rate"] == pytest.approx(0.75 - 1 / rows)
  assert np.isfinite(metrics["reward_mean"]) and np.isfinite(metrics["loss"])
  assert metrics["update_skipped"] == 0.0


def test_vllm_engine_receives_the_restored_weights(tmp_path, monkeypatch):
  """`rollout.engine=vllm` (a stand-in engine here): after a resume the
  engine generates from the checkpoint's weights, not the initial ones."""
  import jax
  from cmimem_jax.rl import step as step_module
  from cmimem_jax.sampling import load_tokenizer
  from cmimem_jax.task import loop as loop_module

  class StandInVLLM(ScriptedEngine):
    reports_learner_logprobs = False  # As vLLM's: the learner recomputes.

    def update_metrics(self):
      return {"vllm_weight_push": self.last_push}

    def __init__(self, checkpoint, eos_ids, pad_id, buckets, **kwargs):
      del checkpoint, eos_ids, pad_id, buckets, kwargs
      super().__init__(load_tokenizer(""))
      self.pushed, self.last_push = [], None

    def set_model(self, model):
      self.pushed.append(np.asarray(jax.device_get(model.embed[...])))
      self.last_push = "load_weights"

  monkeypatch.setattr(loop_module, "import_vllm", lambda: None)
  monkeypatch.setattr(loop_module, "VLLMEngine", StandInVLLM)
  recomputed = []
  recompute = step_module.recompute_logprobs
  monkeypatch.setattr(step_module, "recompute_logprobs", lambda *args: (
      recomputed.append(1), recompute(*args))[1])
  overrides = {"rl.max_steps": 1, "rollout.engine": "vllm"}
  first = Trainer(tiny_config(**overrides), str(tmp_path))
  assert first.config.rl.old_logprobs == "learner"
  initial = np.asarray(jax.device_get(
      first.learner.params["embed"]))
  (metrics,) = first.run()
  trained = np.asarray(jax.device_get(
      first.learner.params["embed"]))
  assert not np.array_equal(initial, trained)
  # On-policy old log-probs (the default): no separate forward, ratio 1 on
  # every token, and the engine's log-probs (0 here: far from the
  # policy's) logged as the mismatch.
  assert not recomputed and "sampler_trainer_logprob_gap" not in metrics
  assert metrics["ratio_deviation_max"] == 0.0
  assert metrics["logprob_gap"] > 1 and metrics["rollout_probs_diff_max"] > 0
  assert metrics["vllm_weight_push"] == "load_weights"

  # "sampler" (several updates per step) recomputes them in JAX first.
  resumed = Trainer(tiny_config(**{**overrides, "rl.max_steps": 2,
                                   "rl.old_logprobs": "sampler"}),
                    str(tmp_path))
  assert resumed.resumed_from == 1
  engine = resumed.policy.engine
  assert len(engine.pushed) == 1  # Pushed once, before any rollout.
  np.testing.assert_array_equal(engine.pushed[0], trained)
  metrics = resumed.run()[0]
  assert recomputed == [1]
  assert metrics["vllm_weight_push"] == "load_weights"
  assert metrics["sampler_trainer_logprob_gap"] > 1
  assert metrics["logprob_gap"] < 1e-4  # Against the recomputed ones.


def test_logprob_estimator_scores_with_the_frozen_reference(tmp_path):
  """App. E: p_ref is the initial policy. A GRPO update moves the policy
  (the live weights) but not the estimator's values, also with no KL term
  (kl_beta 0: the reference is kept for the estimator alone)."""
  loop = Trainer(tiny_config(**{
      "rl.max_steps": 1, "rl.kl_beta": 0.0, "rl.learning_rate": 0.05,
      "reward.estimator": "logprob", "reward.profile_max_new_tokens": 4}),
      str(tmp_path))
  episode = loop.episode(loop.curriculum.batch(0)[0])
  after = apply_to_copy(episode.bank, episode.session, parse(RESPONSES[0]),
                        loop.encoder, loop.memory)
  context = episode.session.format()[:300]
  before_msgs = [profile_messages(episode.bank, context)]
  after_msgs = [profile_messages(after, context)]
  gain = loop.reward.profile_lm.profile_gain(before_msgs, after_msgs)
  policy_before = jax.device_get(loop.learner.params)
  # Valid and invalid responses: rewards differ, so the update is real.
  loop.policy.engine = ScriptedEngine(loop.policy.tokenizer)
  loop.step()
  moved = jax.device_get(loop.learner.params)
  assert any(not np.array_equal(a, b) for a, b in zip(
      jax.tree.leaves(policy_before), jax.tree.leaves(moved)))
  np.testing.assert_array_equal(
      loop.reward.profile_lm.profile_gain(before_msgs, after_msgs), gain)


def _wait_for(predicate, timeout, what):
  deadline = time.monotonic() + timeout
  while not predicate():
    if time.monotonic() > deadline:
      raise AssertionError(f"timed out waiting for {what}")
    time.sleep(0.2)


def test_cli_one_writer_sigint_resume_and_summary(tmp_path):
  """`python -m cmimem_jax.train --config=configs/tiny.py` as a user runs
  it. Two trainers on one workdir: the second stops at once naming the
  first. Ctrl-C mid-run: the step in progress finishes, a checkpoint is
  saved, the run exits 130 with one line (no traceback, no segfault). The
  same command again resumes where the curriculum stopped, keeps the
  steps already logged and prints progress and the summary (reward table,
  one session's memory before and after GRPO, no library INFO logs). That
  a resumed run computes what an uninterrupted one does is
  `test_crash_between_checkpoints_then_resume_with_a_snapshot_refresh`'s
  (the checkpoint a signal saves is the same `save_checkpoint`)."""
  run = tmp_path / "run"
  command = [sys.executable, "-m", "cmimem_jax.train",
             "--config=configs/tiny.py", f"--workdir={run}",
             # conftest gives this process (and so the child) 8 CPU devices.
             "--config.mesh=fsdp:2,tensor:4", "--config.tensorboard=False",
             "--config.rl.max_steps=3", "--config.checkpoint.every_steps=3"]
  first = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
  try:
    _wait_for(lambda: (run / ".lock").exists(), 300, "the lock")
    second = subprocess.run(command, cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert second.returncode == 1
    message = second.stderr.strip().splitlines()[-1]
    assert "in use by train (pid" in message and "Traceback" not in (
        second.stderr)
    _wait_for(lambda: len(read_metrics(str(run))) >= 1, 600, "step 1")
    first.send_signal(signal.SIGINT)
    progress, stderr = first.communicate(timeout=600)
  finally:
    first.kill()
  assert first.returncode == 130, stderr[-3000:]
  assert "Traceback" not in stderr and "Segmentation" not in stderr
  assert stderr.strip().splitlines()[-1].startswith("stopped by SIGINT after "
                                                    "step ")
  # Progress while it works.
  assert "loading the policy" in progress and "step 1/3: reward" in progress
  logged_before = read_metrics(str(run))
  stopped_at = len(logged_before)
  assert 1 <= stopped_at < 3
  assert sorted(os.listdir(run / "checkpoints")) == [str(stopped_at)]
  assert not (run / ".lock").exists()

  resumed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                           timeout=900)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  out = resumed.stdout
  assert f"(resumed from {stopped_at})" in out and "step 3/3: reward" in out
  assert "CMI-Mem training summary" in out and "group spread" in out
  assert "memory written before GRPO (the loaded model):" in out
  assert "memory written after GRPO:" in out
  assert "INFO" not in resumed.stderr  # Third-party logs are off by default.
  summary = json.loads(out.strip().splitlines()[-1])
  assert summary["steps"] == 3 and summary["resumed_from"] == stopped_at
  assert (run / "demo_before.txt").exists()
  got = read_metrics(str(run))
  assert [m["step"] for m in got] == [1, 2, 3]
  assert got[:stopped_at] == logged_before
  config = tiny_config()
  dialogues = training_dialogues(config.dataset)
  _, curriculum = plan_sessions(RLConfig.from_config(config.rl), config.seed,
                                dialogues)
  assert [m["sessions"] for m in got] == [
      [f"{dialogues[r.dialogue].dialogue_id}/{r.session}"
       for r in curriculum.batch(step)] for step in range(3)]
  assert all(np.isfinite(m[key]) for m in got
             for key in ("reward_mean", "loss", "kl"))


def test_bad_numbers_are_rejected_before_anything_compiles(tmp_path,
                                                           compiles):
  before = compiles.count
  for overrides, fragment in (({"rl.learning_rate": float("nan")},
                               "rl.learning_rate=nan"),
                              ({"rl.max_steps": -1}, "rl.max_steps=-1"),
                              ({"rl.kl_beta": -0.1}, "rl.kl_beta=-0.1"),
                              ({"reward.mu": float("inf")}, "reward.mu=inf: must be")):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
      Trainer(tiny_config(**overrides), str(tmp_path))
  assert compiles.count == before
