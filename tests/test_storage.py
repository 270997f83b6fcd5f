"""The path layer (`cmimem_jax.storage`) on local paths and on a GCS
emulator (fake-gcs-server): whole-object atomic writes, appends as
composes, the create-if-absent workdir lock, the metrics files' resume
rule, datasets and memory banks in a bucket, and one-line refusals of
locations nobody can use."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from cmimem_jax import storage
from cmimem_jax.data import load_dataset
from cmimem_jax.data.files import WorkdirBusy, WorkdirLock, write_atomic
from cmimem_jax.data.registry import bundled_path
from cmimem_jax.memory.bank import MemoryBank
from cmimem_jax.rl import MetricsWriter, read_metrics, read_rollouts

ROOT = os.path.join(os.path.dirname(__file__), "..")


@pytest.mark.parametrize("location, fragment", [
    ("gs:/bucket/run", "missing a slash"),
    ("gs:bucket/run", "missing a slash"),
    ("gcs://bucket/run", "did you mean gs://"),
    ("s3://bucket/run", "unsupported scheme s3://"),
    ("gs://", "is not a GCS bucket name"),
    ("gs://b/run", "is not a GCS bucket name"),
    ("gs://My_Bucket/run", "is not a GCS bucket name"),
])
def test_a_location_nobody_handles_is_refused_in_one_line(location, fragment):
  with pytest.raises(storage.StorageError, match=fragment) as caught:
    storage.path(location)
  assert "\n" not in str(caught.value)


@pytest.mark.parametrize("location", ["run:1/metrics", "/tmp/x", "rel/dir",
                                      "gs://bucket.example-1/run"])
def test_local_paths_and_good_urls_pass_the_check(location):
  assert storage.check_location(location) == location


def test_local_writes_are_what_they_were(tmp_path):
  target = tmp_path / "f.json"
  write_atomic(str(target), "é\n")
  write_atomic(str(target), b"new")
  assert target.read_bytes() == b"new"
  assert os.listdir(tmp_path) == ["f.json"]  # No temp file left.
  storage.create_new(str(tmp_path / "lock"), "one")
  with pytest.raises(FileExistsError):
    storage.create_new(str(tmp_path / "lock"), "two")
  with storage.Appender(str(tmp_path / "log.jsonl")) as log:
    log.write("a\n")
    log.flush()
    assert (tmp_path / "log.jsonl").read_text() == "a\n"
    log.write("b\n")
  assert (tmp_path / "log.jsonl").read_text() == "a\nb\n"


def test_whole_objects_and_create_if_absent_on_gcs(gcs):
  run = gcs.bucket("objects-test") + "/run"
  write_atomic(f"{run}/config.json", '{"a": 1}')
  write_atomic(f"{run}/config.json", b'{"a": 2}')
  assert storage.path(f"{run}/config.json").read_text() == '{"a": 2}'
  storage.create_new(f"{run}/.lock", "first")
  with pytest.raises(FileExistsError):  # ifGenerationMatch=0 refused it.
    storage.create_new(f"{run}/.lock", "second")
  assert storage.path(f"{run}/.lock").read_text() == "first"
  assert gcs.objects("objects-test") == ["objects-test/run/.lock",
                                         "objects-test/run/config.json"]


def test_appends_on_gcs_are_composes_and_stay_under_the_component_limit(
    gcs, monkeypatch):
  log = gcs.bucket("append-test") + "/log.jsonl"
  monkeypatch.setattr(storage, "_MAX_COMPONENTS", 3)
  appender = storage.Appender(log)
  for i in range(6):
    appender.write(f"{i}\n")
    appender.flush()
    assert storage.path(log).read_text() == "".join(
        f"{j}\n" for j in range(i + 1))
  # 1 upload, 2 composes, a whole rewrite (limit), 2 composes.
  assert appender._components == 3
  appender.write("tail\n")
  appender.close()
  assert storage.path(log).read_text().endswith("5\ntail\n")
  assert gcs.objects("append-test") == ["append-test/log.jsonl"]
  # A reopened appender continues the object.
  with storage.Appender(log) as again:
    again.write("more\n")
  assert storage.path(log).read_text().endswith("tail\nmore\n")


def test_workdir_lock_on_gcs_names_its_holder_and_expires_with_its_lease(
    gcs, caplog):
  run = gcs.bucket("lock-test") + "/run"
  mine = WorkdirLock(run, "train").acquire()
  holder = json.loads(storage.path(f"{run}/.lock").read_text())
  assert holder["pid"] == os.getpid() and holder["job"] == "train"
  assert mine.acquire() is mine  # Re-entrant.
  mine.release()
  assert not storage.path(f"{run}/.lock").exists()
  # Another host's lock (a VM this one cannot check).
  storage.create_new(f"{run}/.lock", json.dumps(
      {"pid": 4242, "host": "tpu-vm-0", "job": "train",
       "command": "python -m cmimem_jax.train --workdir=" + run}))
  with pytest.raises(WorkdirBusy, match=r"in use by train \(pid 4242 on "
                     r"tpu-vm-0: python -m cmimem_jax.train"):
    WorkdirLock(run, "evaluate").acquire()
  # A preempted VM stops refreshing its lock: after the lease it is stale.
  successor = WorkdirLock(run, "train", lease_s=0.0)
  successor.acquire()
  assert "not refreshed" in caplog.text
  assert json.loads(storage.path(f"{run}/.lock").read_text())["pid"] == (
      os.getpid())
  successor.release()


def test_metrics_resume_rule_and_tensorboard_on_gcs(gcs, monkeypatch):
  run = gcs.bucket("metrics-test") + "/run"
  # Event files go through the path layer's appends, never tensorboardX's
  # own gs:// writer (google-cloud-storage, the whole file uploaded again
  # at every flush): switched off here, it would fail if it were used.
  from tensorboardX import record_writer
  monkeypatch.setattr(record_writer, "GCS_ENABLED", False)
  writer = MetricsWriter(run, tensorboard=True, progress=False,
                         rollouts=True)
  for step in (1, 2, 3):
    writer.write(step, {"loss": 0.5 * step})
    writer.write_rollouts(step, [{"reward": step}, {"reward": -step}])
    # Durable after every step, as the local file is.
    assert [m["step"] for m in read_metrics(run)] == list(range(1, step + 1))
  writer.close()
  time.sleep(1.1)  # Event files are named by the second they start in.
  # Resumed from checkpoint 2: step 3 runs again, its records go first.
  writer = MetricsWriter(run, tensorboard=True, progress=False,
                         rollouts=True, start_step=2)
  assert [m["step"] for m in read_metrics(run)] == [1, 2]
  writer.write(3, {"loss": 9.0})
  writer.write_rollouts(3, [{"reward": 7}])
  writer.close()
  assert [(m["step"], m["loss"]) for m in read_metrics(run)] == [
      (1, 0.5), (2, 1.0), (3, 9.0)]
  assert [r["step"] for r in read_rollouts(run)] == [1, 1, 2, 2, 3]
  events = [o for o in gcs.objects("metrics-test/run/tensorboard")
            if "tfevents" in o]
  assert len(events) == 2  # One event file per run, as locally.
  assert [_scalars(gcs.fs.cat_file(o)) for o in events] == [
      [(1, 0.5), (2, 1.0), (3, 1.5)], [(3, 9.0)]]


def _scalars(data: bytes) -> list[tuple[int, float]]:
  """(step, value) of the `loss` scalars in an event file's bytes (TFRecord
  framing: length, its CRC, the Event proto, its CRC)."""
  from tensorboardX.proto.event_pb2 import Event
  found, offset = [], 0
  while offset < len(data):
    length = int.from_bytes(data[offset:offset + 8], "little")
    event = Event.FromString(data[offset + 12:offset + 12 + length])
    offset += 16 + length
    found += [(event.step, round(v.simple_value, 4))
              for v in event.summary.value if v.tag == "loss"]
  return found


def test_a_dataset_and_a_memory_bank_in_a_bucket(gcs, encoder):
  bucket = gcs.bucket("data-test")
  local = bundled_path("longmemeval_train_sample.json")
  gcs.fs.put_file(local, "data-test/sample.json")
  remote = load_dataset("longmemeval", f"{bucket}/sample.json")
  assert remote == load_dataset("longmemeval", local)
  bank = MemoryBank("user", encoder.dim)
  bank.core = "likes tea"
  first = bank.save(f"{bucket}/banks/user")
  bank.core = "likes coffee"
  second = bank.save(f"{bucket}/banks/user")
  assert MemoryBank.load(f"{bucket}/banks/user") == bank
  # CURRENT names the new version; the old one is gone.
  assert not storage.path(first).exists() and storage.path(second).exists()


def test_a_missing_bucket_client_or_endpoint_is_one_line(gcs, monkeypatch):
  with pytest.raises(storage.StorageError, match="bucket gs://no-such-bucket "
                     "does not exist.*gcloud storage buckets create"):
    storage.path("gs://no-such-bucket/run")
  assert "no-such-bucket" not in gcs.fs.ls("")  # Not created on the way.
  monkeypatch.setattr(storage, "_checked", set())
  monkeypatch.setitem(sys.modules, "gcsfs", None)
  with pytest.raises(storage.StorageError, match=r"need gcsfs.*\.\[gcs\]"):
    storage.path("gs://some-bucket/run")
  monkeypatch.delitem(sys.modules, "gcsfs")
  monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:9")
  with pytest.raises(storage.StorageError, match="cannot reach the GCS "
                     "emulator at http://127.0.0.1:9"):
    storage.path("gs://some-bucket/run")


def _train(workdir: str, cwd: str, env: dict[str, str] | None = None
           ) -> subprocess.CompletedProcess:
  return subprocess.run(
      [sys.executable, "-m", "cmimem_jax.train",
       f"--config={os.path.abspath(ROOT)}/configs/tiny.py",
       f"--workdir={workdir}"], cwd=cwd, capture_output=True, text=True,
      timeout=300, env=env or dict(os.environ,
                                   PYTHONPATH=os.path.abspath(ROOT)))


def test_train_refuses_a_location_nobody_can_use_before_any_work(gcs,
                                                                 tmp_path):
  """As a user types them: one line, exit 1, nothing written anywhere
  (no `gs:` directory, no object)."""
  gcs.bucket("untouched")
  missing_client = tmp_path / "no_gcsfs"
  (missing_client / "gcsfs").mkdir(parents=True)
  (missing_client / "gcsfs" / "__init__.py").write_text(
      "raise ImportError('No module named gcsfs')\n")
  cases = [("gs:/untouched/run", None, "missing a slash"),
           ("gs://no-such-bucket/run", None, "does not exist"),
           ("gs://untouched/run", dict(
               os.environ, PYTHONPATH=f"{missing_client}:{os.path.abspath(ROOT)}"),
            "need gcsfs")]
  for location, env, fragment in cases:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    result = _train(location, str(cwd), env)
    assert result.returncode == 1, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], result.stderr[-2000:]
    assert os.listdir(cwd) == [], location
    shutil.rmtree(cwd)
  assert gcs.objects("untouched") == []


def test_a_bucket_that_refuses_writes_is_one_line_at_the_lock(gcs,
                                                              monkeypatch):
  """GCS answers 403 to a write without storage.objects.create (gcsfs
  raises `OSError("Forbidden: ...")`; the emulator has no permissions, so
  its upload is made to answer so): the lock, a job's first write, stops
  it with what to do, and nothing is written."""
  run = gcs.bucket("read-only") + "/run"

  def forbidden(path, *args, **kwargs):
    raise OSError(f"Forbidden: {path}\ncaller does not have "
                  "storage.objects.create access")

  assert storage.filesystem() is gcs.fs  # The one every write goes through.
  monkeypatch.setattr(gcs.fs, "pipe_file", forbidden)
  with pytest.raises(storage.StorageError, match="refuses writes.*"
                     "storage.objects.create") as caught:
    WorkdirLock(run, "train").acquire()
  assert "\n" not in str(caught.value)
  assert gcs.objects("read-only") == []


def test_a_held_remote_lock_is_refreshed_and_never_taken_back(gcs, caplog):
  run = gcs.bucket("refresh-test") + "/run"
  lock = WorkdirLock(run, "train", lease_s=4.0)  # Refreshed every 1 s.
  lock.acquire()
  first = storage.path(f"{run}/.lock").stat().mtime
  time.sleep(2.5)
  assert storage.path(f"{run}/.lock").stat().mtime > first
  # Its lease missed, a successor on another host took it over: the
  # holder stops refreshing (it would overwrite the successor's lock).
  successor = json.dumps({"pid": 7, "host": "tpu-vm-1", "job": "train"})
  write_atomic(f"{run}/.lock", successor)
  time.sleep(2.5)
  assert storage.path(f"{run}/.lock").read_text() == successor
  assert "was taken over by train (pid 7 on tpu-vm-1)" in caplog.text
  lock.release()  # Not its lock any more: left in place.
  assert storage.path(f"{run}/.lock").read_text() == successor


def test_a_second_emulator_gives_its_children_its_own_endpoints_only(
    gcs, tmp_path):
  """The rehearsal's emulator inside a test session's (tools/rehearse.py
  under pytest): its children's tensorstore URL is its own, not the
  session's (whose server has no such bucket: Orbax's arrays got 404s)."""
  from cmimem_jax.testing.gcs_emulator import GcsEmulator
  outer = dict(os.environ)
  assert outer["TENSORSTORE_GCS_HTTP_URL"] == gcs.url
  with GcsEmulator(str(tmp_path / "inner")) as inner:
    child = inner.child_environment(outer)
  assert inner.url != gcs.url
  assert child["STORAGE_EMULATOR_HOST"] == inner.url
  assert child["TENSORSTORE_GCS_HTTP_URL"] == inner.url
  assert os.environ["TENSORSTORE_GCS_HTTP_URL"] == gcs.url  # Restored.
