"""The training loop never takes a failure for a result: QA calls that
fail stop the step before its update; a checkpoint save that fails (a
full disk) is one line, leaves no temporary checkpoint and cuts the
metrics back to the last saved step, and a rerun with space resumes
exactly (on a real tmpfs where this machine lets us mount one)."""

import collections
import contextlib
import os
import pathlib
import shutil
import subprocess
import sys
import types

import jax
import numpy as np
import pytest

from cmimem_jax.config import CallsFailed
from cmimem_jax.rl import read_metrics
from cmimem_jax.rl.checkpoint import CheckpointNotSaved
from cmimem_jax.task.loop import Trainer
from cmimem_jax.task.qa_reward import PendingQA, QAConfig

from full_disk import assert_full_disk_line, fail_writes_of  # noqa: I100
from test_train import ScriptedEngine, tiny_config

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
  """A tiny trainer of 2 steps, a checkpoint after each, with scripted
  rollouts."""
  loop = Trainer(tiny_config(**{"rl.max_steps": 2,
                                "checkpoint.every_steps": 1}),
                 str(tmp_path_factory.mktemp("run")))
  loop.policy.engine = ScriptedEngine(loop.policy.tokenizer)
  return loop


class QACallsFail:
  """The QA reward with every answer call failed (a dead endpoint)."""

  def __init__(self, qa):
    self.failures = qa.failures

  def submit(self, bank, episode):
    del bank
    self.failures["answer"] += len(episode.questions)
    return PendingQA(self, {})

  def __call__(self, bank, episode):
    return self.submit(bank, episode).wait()


@pytest.mark.slow
def test_failed_qa_calls_stop_the_step_before_its_update(trainer):
  params = jax.tree.map(np.asarray, trainer.learner.params)
  qa = trainer.qa
  trainer.qa = QACallsFail(qa)
  try:
    with pytest.raises(CallsFailed, match=(
        r"^all \d+ QA questions of step 1 could not be judged \(answer "
        r"http://\S+, judge http://\S+\) failed; no update made from them")):
      trainer.step()
  finally:
    trainer.qa = qa
  assert trainer.loop.step == 0
  jax.tree.map(np.testing.assert_array_equal, params,
               jax.tree.map(np.asarray, trainer.learner.params))


@pytest.mark.slow
def test_a_failed_save_cuts_the_metrics_back_to_the_last_saved_step(
    trainer):
  """`Trainer.run` with checkpoint 2's writes failing on a full disk:
  the error is one line, no temporary checkpoint is left, metrics.jsonl
  ends at step 1 (the saved checkpoint)."""
  workdir = pathlib.Path(trainer.workdir)
  with pytest.MonkeyPatch.context() as patch:
    fail_writes_of(2, patch)
    with pytest.raises(CheckpointNotSaved) as failed:
      trainer.run()
  assert_full_disk_line(str(failed.value), workdir / "checkpoints" / "2",
                        workdir / "metrics.jsonl", 1)
  assert sorted(os.listdir(workdir / "checkpoints")) == ["1"]
  assert [m["step"] for m in read_metrics(str(workdir))] == [1]


def test_the_qa_gate_counts_the_questions_of_valid_rollouts():
  """`Trainer._check_qa_failures` alone (the trainer-level test above is
  slow): failures over the questions valid rollouts were asked."""
  episodes = [types.SimpleNamespace(questions=[1, 2]),
              types.SimpleNamespace(questions=[1, 2, 3])]
  terms = [types.SimpleNamespace(valid=v) for v in (True, False, True, True)]
  config = tiny_config(**{"qa.max_failure_rate": 0.3})
  stub = types.SimpleNamespace(
      qa=types.SimpleNamespace(failures=collections.Counter(judge=2)),
      qa_config=QAConfig.from_config(config.qa), group=2)
  # 2 + 3 + 3 = 8 questions asked; 2 failed (25 %) pass at 30 %.
  Trainer._check_qa_failures(stub, 1, episodes, terms, 0)
  stub.qa.failures["answer"] += 1
  with pytest.raises(CallsFailed, match=r"^3 of 8 QA questions of step 1 "):
    Trainer._check_qa_failures(stub, 1, episodes, terms, 0)
  Trainer._check_qa_failures(stub, 1, episodes, terms, 3)  # None new.


def _mount_tmpfs(path: pathlib.Path, size: str) -> bool:
  path.mkdir(parents=True, exist_ok=True)
  try:
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}",
                           "tmpfs", str(path)], capture_output=True,
                          timeout=30)
  except (OSError, subprocess.TimeoutExpired):
    return False
  return done.returncode == 0


@contextlib.contextmanager
def small_filesystem(path: pathlib.Path, size: str):
  if not _mount_tmpfs(path, size):
    pytest.skip("cannot mount a tmpfs here (needs root): the full-disk "
                "path is covered by the injected fault above")
  try:
    yield path
  finally:
    subprocess.run(["umount", "-l", str(path)], check=False, timeout=30)


@pytest.mark.slow
def test_train_on_a_full_tmpfs_then_resumed_with_space(tmp_path):
  """`python -m cmimem_jax.train --config=configs/tiny.py` on a 20 MB
  tmpfs with 2 MB free (the issue's case): exit 1 with one line, no
  traceback, no temporary checkpoint, metrics.jsonl ends at the last
  saved step; space freed, the same command resumes and logs what an
  uninterrupted run logs."""
  command = [sys.executable, "-m", "cmimem_jax.train",
             "--config=configs/tiny.py", "--config.mesh=fsdp:2,tensor:4",
             "--config.tensorboard=False"]
  whole = subprocess.run(command + [f"--workdir={tmp_path / 'whole'}"],
                         cwd=ROOT, capture_output=True, text=True,
                         timeout=900)
  assert whole.returncode == 0, whole.stderr[-3000:]
  with small_filesystem(tmp_path / "fs", "20m") as disk:
    filler = disk / "filler"
    with open(filler, "wb") as f:
      f.write(b"\0" * (18 << 20))
    run = disk / "run"
    full = subprocess.run(command + [f"--workdir={run}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert full.returncode == 1, full.stderr[-3000:]
    assert "Traceback" not in full.stderr
    lines = full.stderr.strip().splitlines()
    assert len(lines) == 1, full.stderr[-3000:]
    assert lines[0].startswith(f"error: CheckpointNotSaved: checkpoint "
                               f"{run / 'checkpoints'}/"), lines
    assert "no space left on the device (a checkpoint holds" in lines[0]
    assert not list((run / "checkpoints").glob("*tmp*"))
    saved = sorted(int(p.name) for p in (run / "checkpoints").iterdir())
    last = saved[-1] if saved else 0
    assert [m["step"] for m in read_metrics(str(run))] == list(
        range(1, last + 1))
    assert f"ends at step {last}, the last saved checkpoint" in lines[0]
    filler.unlink()  # Space: room for two checkpoints (the new, the old).
    subprocess.run(["mount", "-o", "remount,size=200m", str(disk)],
                   check=True, timeout=30)
    resumed = subprocess.run(command + [f"--workdir={run}"], cwd=ROOT,
                             capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got = read_metrics(str(run))
    shutil.copy(run / "metrics.jsonl", tmp_path / "resumed_metrics.jsonl")
  expected = read_metrics(str(tmp_path / "whole"))
  assert [m["step"] for m in got] == [m["step"] for m in expected]
  for a, b in zip(got, expected):
    assert a["sessions"] == b["sessions"]
    for key in ("reward_mean", "validity_rate", "loss"):
      assert a[key] == pytest.approx(b[key], abs=1e-5), (key, a, b)
