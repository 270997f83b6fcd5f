"""Torn JSONL tails, atomic rewrites, safe names for dataset ids, and the
one-writer lock of a workdir."""

import json
import os
import socket
import subprocess
import sys

import pytest

from cmimem_jax.data import (WorkdirBusy, WorkdirLock, path_under, read_jsonl,
                             rewrite_jsonl, safe_name)
from cmimem_jax.data.files import LOCK_FILE


def test_a_torn_last_line_is_dropped_and_cut_from_the_file(tmp_path):
  path = str(tmp_path / "log.jsonl")
  with open(path, "w") as f:
    f.write('{"a": 1}\n{"a": 2}\n{"a": 3, "tor')  # Killed mid-write.
  assert read_jsonl(path) == [{"a": 1}, {"a": 2}]
  with open(path, "a") as f:  # The next run appends...
    f.write('{"a": 4}\n')
  assert read_jsonl(path) == [{"a": 1}, {"a": 2}, {"a": 4}]  # ...cleanly.


def test_a_malformed_middle_line_is_corruption_and_raises(tmp_path):
  path = str(tmp_path / "log.jsonl")
  with open(path, "w") as f:
    f.write('{"a": 1}\n{oops\n{"a": 3}\n')
  with pytest.raises(ValueError, match=r"log.jsonl:2: malformed record"):
    read_jsonl(path)


def test_missing_file_and_rewrite(tmp_path):
  path = str(tmp_path / "log.jsonl")
  assert read_jsonl(path) == []
  rewrite_jsonl(path, [{"step": 1}, {"step": 2}])
  assert read_jsonl(path) == [{"step": 1}, {"step": 2}]
  assert not os.path.exists(path + ".tmp")


@pytest.mark.parametrize("identifier", ["", ".", "..", "../venv", "a/b",
                                        "conv:1", "x" * 300, "..\\x"])
def test_unsafe_ids_become_distinct_plain_names(identifier):
  name = safe_name(identifier)
  assert name not in ("", ".", "..") and "/" not in name and "\\" not in name
  assert len(name) <= 64 and safe_name(identifier + "!") != name


def test_safe_ids_are_kept_and_paths_stay_under_their_root(tmp_path):
  assert safe_name("conv-26") == "conv-26"
  root = str(tmp_path / "banks")
  for identifier in ("..", "../../etc", "/abs", ""):
    path = path_under(root, "policy", identifier)
    assert os.path.dirname(path) == os.path.join(root, "policy")


def test_a_record_that_lost_only_its_newline_is_terminated(tmp_path):
  """A write cut after the JSON but before "\\n": the record is kept and
  terminated, so the next append starts a line of its own."""
  path = tmp_path / "log.jsonl"
  path.write_text('{"a": 1}\n{"a": 2}')
  assert read_jsonl(str(path)) == [{"a": 1}, {"a": 2}]
  with open(path, "a") as f:
    f.write('{"a": 3}\n')
  assert read_jsonl(str(path)) == [{"a": 1}, {"a": 2}, {"a": 3}]


def _write_holder(path, **holder):
  path.write_text(json.dumps(holder))


def test_one_writer_per_workdir(tmp_path):
  first = WorkdirLock(str(tmp_path), "train").acquire()
  holder = json.loads((tmp_path / LOCK_FILE).read_text())
  assert holder["pid"] == os.getpid() and holder["job"] == "train"
  # Re-entrant in the holder's own process.
  assert WorkdirLock(str(tmp_path), "train").acquire()
  first.release()
  assert not (tmp_path / LOCK_FILE).exists()
  # A live holder elsewhere (here: this machine's pid 1): refused, named.
  _write_holder(tmp_path / LOCK_FILE, pid=1, host=socket.gethostname(),
                job="evaluate", command="python -m cmimem_jax.evaluate")
  with pytest.raises(WorkdirBusy, match="in use by evaluate .pid 1 on"):
    WorkdirLock(str(tmp_path), "train").acquire()
  # Another host cannot be checked: refused too.
  _write_holder(tmp_path / LOCK_FILE, pid=os.getpid(), host="elsewhere",
                job="train", command="x")
  with pytest.raises(WorkdirBusy, match="on elsewhere"):
    WorkdirLock(str(tmp_path), "sft").acquire()


def test_a_stale_lock_of_a_dead_process_is_taken_over(tmp_path):
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  _write_holder(tmp_path / LOCK_FILE, pid=dead.pid, host=socket.gethostname(),
                job="train", command="killed -9")
  lock = WorkdirLock(str(tmp_path), "train").acquire()
  assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
  lock.release()
  # A recycled pid is no holder either: its start time differs.
  _write_holder(tmp_path / LOCK_FILE, pid=os.getpid(),
                host=socket.gethostname(), start="1", job="train",
                command="long gone")
  with WorkdirLock(str(tmp_path), "train"):
    pass
