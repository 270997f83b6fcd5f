"""A TPU user's `--workdir=gs://...`, end to end on a GCS emulator
(fake-gcs-server, `cmimem_jax.testing.gcs_emulator`): training on a
bucket survives kill -9 and resumes exactly, a second trainer is refused,
the tools read the run, an SFT checkpoint in the bucket warm-starts GRPO
whose data comes from the bucket. (SIGTERM and resume, evaluate at a kept
step and compare_paper on gs://: `tools/rehearse.py`'s stages.)"""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from cmimem_jax import storage
from cmimem_jax.config import apply_overrides
from cmimem_jax.data import bundled_path
from cmimem_jax.rl import Checkpointer, read_metrics, read_rollouts
from cmimem_jax.task.loop import (RLConfig, Trainer, plan_sessions,
                                  training_dialogues)
from cmimem_jax.task.warm_start import run_sft, write_jsonl
from cmimem_jax.testing import run_tool
from configs import small_repro, tiny

pytestmark = pytest.mark.slow
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def _wait_for(predicate, timeout: float, what: str,
              process: subprocess.Popen | None = None) -> None:
  deadline = time.monotonic() + timeout
  while not predicate():
    if process is not None and process.poll() is not None:
      raise AssertionError(f"exited {process.returncode} before {what}: "
                           f"{process.stderr.read()[-3000:]}")
    if time.monotonic() > deadline:
      raise AssertionError(f"timed out waiting for {what}")
    time.sleep(0.2)


def test_train_on_a_bucket_resumes_after_kill_9(gcs, tmp_path):
  """`python -m cmimem_jax.train --workdir=gs://...` run from an empty
  directory: a second trainer is refused naming the first; SIGKILL in
  step 2 (or its checkpoint's save) leaves a stale lock that the rerun
  takes over, and it resumes: steps 1..2 logged once each, in the
  curriculum's order, rollouts too. Nothing local is written (the
  compilation cache is the session's), and the tools read the run from the
  bucket. (SIGTERM mid-step and its resume on a bucket: the rehearsal's
  train stage, tests/test_rehearse.py.)"""
  run = gcs.bucket("train-run") + "/run"
  cwd = tmp_path / "cwd"
  cwd.mkdir()
  command = [sys.executable, "-m", "cmimem_jax.train",
             f"--config={ROOT}/configs/tiny.py", f"--workdir={run}",
             "--config.mesh=fsdp:2,tensor:4", "--config.rl.max_steps=2",
             "--config.checkpoint.every_steps=1",
             "--config.rl.log_rollouts=True"]
  env = dict(os.environ, PYTHONPATH=ROOT)
  lock = storage.path(f"{run}/.lock")
  first = subprocess.Popen(command, cwd=cwd, env=env, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  try:
    _wait_for(lock.exists, 300, "the lock", first)
    second = subprocess.run(command, cwd=cwd, env=env, capture_output=True,
                            text=True, timeout=300)
    assert second.returncode == 1
    assert second.stderr.strip().splitlines()[-1].startswith(
        f"error: WorkdirBusy: {run} is in use by train (pid {first.pid} on ")
    _wait_for(lambda: len(read_metrics(run)) >= 1, 600, "step 1", first)
    first.send_signal(signal.SIGKILL)  # In step 2, or step 1's save.
    first.wait(60)
  finally:
    first.kill()
  assert first.returncode == -signal.SIGKILL and lock.exists()
  assert [m["step"] for m in read_metrics(run)] == [1]

  resumed = subprocess.run(command, cwd=cwd, env=env, capture_output=True,
                           text=True, timeout=900)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "step 2/2" in resumed.stdout and not lock.exists()
  assert "taking over a stale lock" in resumed.stderr
  got = read_metrics(run)
  assert [m["step"] for m in got] == [1, 2]
  config = tiny.get_config()
  dialogues = training_dialogues(config.dataset)
  _, curriculum = plan_sessions(RLConfig.from_config(config.rl), config.seed,
                                dialogues)
  assert [m["sessions"] for m in got] == [
      [f"{dialogues[r.dialogue].dialogue_id}/{r.session}"
       for r in curriculum.batch(step)] for step in range(2)]
  rows = config.rl.sessions_per_batch * config.rollout.num_rollouts
  assert [r["step"] for r in read_rollouts(run)] == [
      s for s in (1, 2) for _ in range(rows)]
  assert json.loads(storage.path(f"{run}/config.json").read_text())[
      "rl"]["max_steps"] == 2
  assert gcs.fs.exists("train-run/run/checkpoints/2/commit_success.txt")
  assert any("tensorboard/events.out.tfevents" in name
             for name in gcs.objects("train-run/run"))
  # Nothing local: no `gs:` directory, here or in the repository.
  assert os.listdir(cwd) == []
  assert not os.path.exists(os.path.join(ROOT, "gs:"))

  from tools import skip_report
  assert run_tool(skip_report, [run, f"--output={run}/skips.json"]) == 0
  counts = json.loads(storage.path(f"{run}/skips.json").read_text())
  assert sum(c["rollouts"] for c in counts[run].values()) == 2 * rows


def test_sft_in_a_bucket_warm_starts_train_on_a_dataset_in_the_bucket(
    gcs, tmp_path):
  bucket = gcs.bucket("warm-start")
  gcs.fs.put_file(bundled_path(), "warm-start/data/sample.json")
  write_jsonl(f"{bucket}/data/teacher.jsonl", [
      {"messages": [{"role": "user", "content": f"Session {i}: I like tea."}],
       "response": "CORE:APPEND|Likes tea\nEPISODIC:SKIP\nSEMANTIC:ADD|"
                   f"Tea - drink {i}\nPROCEDURAL:SKIP\n"} for i in range(8)])
  config = tiny.get_config()
  config.sft = small_repro.get_config().sft
  apply_overrides(config, {
      "mesh": "data:2,tensor:4", "tensorboard": False,
      "dataset.path": f"{bucket}/data/sample.json", "dataset.dialogues": 2,
      "sft.data": f"{bucket}/data/teacher.jsonl", "sft.max_steps": 2,
      "sft.batch_size": 8, "sft.max_prompt_tokens": 64,
      "sft.max_response_tokens": 48, "sft.buckets": (64,),
      "rl.max_steps": 1})
  run_sft(config, f"{bucket}/sft")
  assert [m["step"] for m in read_metrics(f"{bucket}/sft")] == [1, 2]
  config.policy.init_checkpoint = f"{bucket}/sft"
  loop = Trainer(config, f"{bucket}/rl")
  assert [d.dialogue_id for d in loop.dialogues] == [
      d.dialogue_id for d in training_dialogues(apply_overrides(
          config.copy_and_resolve_references(),
          {"dataset.path": bundled_path()}).dataset)]
  _, saved = Checkpointer(f"{bucket}/sft/checkpoints", read_only=True
                          ).restore_params(loop.learner.params)
  for ours, want in zip(jax.tree.leaves(jax.device_get(loop.learner.params)),
                        jax.tree.leaves(jax.device_get(saved))):
    np.testing.assert_array_equal(ours, want)
  loop.lock.release()
  # Both runs' files are in the bucket, nothing under a local `gs:`.
  assert gcs.fs.exists("warm-start/sft/checkpoints/2/commit_success.txt")
  assert gcs.fs.exists("warm-start/rl/config.json")
  assert not os.path.exists(os.path.join(os.getcwd(), "gs:"))


def test_plan_reads_a_checkpoints_architecture_from_a_bucket(gcs, tmp_path):
  from tools import plan
  from cmimem_jax.testing import standins
  tokenizer = standins.make_tokenizer(str(tmp_path / "tokenizer"),
                                      standins.corpus())
  local = standins.make_policy_checkpoint(str(tmp_path / "policy"),
                                          tokenizer)
  remote = gcs.bucket("plan-test") + "/policy"
  gcs.fs.put_file(os.path.join(local, "config.json"),
                  "plan-test/policy/config.json")
  arguments = [f"--config={ROOT}/configs/qwen3_4b_tpu.py", "--topology=cpu:1",
               "--programs=train", "--length=64", "--completion=8"]
  (row,) = run_tool(plan, [*arguments, f"--checkpoint={remote}"])
  (want,) = run_tool(plan, [*arguments, f"--checkpoint={local}"])
  # Tokenizers are read from local folders only: the bucket's run costs
  # with the stand-in (same EOS id, so the same shapes and programs).
  assert row.pop("stand_ins") == {
      "tokenizer": "stand-in: the architecture's EOS id, pad 0"}
  assert want.pop("stand_ins") == {"tokenizer": "the config's"}
  del row["compile_s"], want["compile_s"]
  assert row == want and row["layers"] == 2
