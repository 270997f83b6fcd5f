"""A checkpoint save that fails (a full disk) is one error naming the
checkpoint and the space it needs, leaves no temporary directory, and a
run's metrics end at the last saved step; the checkpoint before it still
restores exactly. The fault is injected inside orbax's write path (where
tensorstore raises on ENOSPC); tests/test_train_failures.py fills a real
tmpfs."""

import glob
import json
import logging

import jax
import numpy as np
import pytest
from orbax.checkpoint._src.serialization import serialization

from cmimem_jax.rl import Checkpointer, MetricsWriter, read_metrics
from cmimem_jax.rl.checkpoint import (CheckpointNotSaved,
                                      metrics_follow_checkpoints, out_of_space)

from full_disk import (TENSORSTORE_ENOSPC,  # noqa: I100
                       assert_full_disk_line, fail_writes_of)

def _state(seed: int) -> tuple[dict, dict]:
  rng = np.random.default_rng(seed)
  params = {"w": jax.numpy.asarray(rng.standard_normal((64, 32)),
                                   jax.numpy.float32)}
  return params, {"m": jax.tree.map(lambda x: x * 0.5, params)}


@pytest.mark.parametrize("async_save", [True, False])
def test_a_failed_save_is_one_error_and_metrics_end_at_the_last_saved(
    tmp_path, monkeypatch, caplog, async_save):
  directory = tmp_path / "checkpoints"
  checkpointer = Checkpointer(str(directory), keep=3, async_save=async_save)
  writer = MetricsWriter(str(tmp_path), tensorboard=False, progress=False,
                         rollouts=True)
  key = jax.random.key(0)
  fail_writes_of(2, monkeypatch)
  saved = _state(1)
  with pytest.raises(CheckpointNotSaved) as failed, caplog.at_level(
      logging.INFO):
    with metrics_follow_checkpoints(checkpointer, writer):
      for step in (1, 2, 3):  # Metrics first, then the save (as `run`).
        writer.write(step, {"loss": float(step)})
        writer.write_rollouts(step, [{"reward": 0.5}, {"reward": 1.0}])
        params, opt_state = _state(step)
        checkpointer.save(step, params, opt_state, key, {"step": step})
      checkpointer.wait()
  writer.close()
  assert_full_disk_line(str(failed.value), directory / "2",
                        tmp_path / "metrics.jsonl", 1)
  assert "(a checkpoint holds 16.0 KiB of arrays, before compression; " in (
      str(failed.value))
  # orbax's threads' reports of the same error are not logged.
  assert not [r for r in caplog.records if "No space" in r.getMessage()
              or (r.exc_info and out_of_space(r.exc_info[1]))]
  assert not glob.glob(str(directory / "*tmp*"))
  assert checkpointer.steps() == [1]
  assert [m["step"] for m in read_metrics(str(tmp_path))] == [1]
  rollouts = (tmp_path / "rollouts.jsonl").read_text().splitlines()
  assert [json.loads(r)["step"] for r in rollouts] == [1, 1]
  # The saved checkpoint restores exactly (what a rerun resumes from).
  monkeypatch.undo()
  restored = Checkpointer(str(directory)).restore(*_state(9), key)
  assert restored.step == 1 and restored.loop_state == {"step": 1}
  np.testing.assert_array_equal(restored.params["w"], saved[0]["w"])
  np.testing.assert_array_equal(restored.opt_state["m"]["w"],
                                saved[1]["m"]["w"])


def test_other_save_errors_name_their_cause(tmp_path, monkeypatch):
  checkpointer = Checkpointer(str(tmp_path), async_save=False)

  async def denied(values, spec, **kwargs):
    raise PermissionError(13, "Permission denied", "x")
  monkeypatch.setattr(serialization, "async_serialize_from_host", denied)
  with pytest.raises(CheckpointNotSaved, match=r"not saved: PermissionError: "
                     r"\[Errno 13\] Permission denied"):
    checkpointer.save(1, *_state(1), jax.random.key(0), {})
  assert not glob.glob(str(tmp_path / "*tmp*"))


def test_out_of_space_is_recognised_through_causes():
  assert out_of_space(OSError(28, "No space left on device"))
  assert out_of_space(ValueError(TENSORSTORE_ENOSPC.format(path="x")))
  wrapped = RuntimeError("save failed")
  wrapped.__cause__ = OSError(122, "Disk quota exceeded")
  assert out_of_space(wrapped)
  assert not out_of_space(ValueError("RESOURCE_EXHAUSTED: out of memory"))
