"""Files the jobs write and read back: JSONL logs that survive a hard kill,
ids from dataset files turned into safe directory names, the workdir lock,
and `write_atomic`, through the path layer of `cmimem_jax.storage` (local
paths and `gs://`).

A process killed mid-write leaves at most one torn (unterminated) line at
the end of an append-only JSONL file; `read_jsonl` drops it and truncates
the file back to its last complete line (or, when only the newline was
lost, terminates the record), so the next append starts clean.
A malformed line anywhere else is real corruption and raises. An object on
object storage is only ever written whole (`storage.Appender`), so it has
no torn line to repair.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from typing import Any

from absl import logging

from cmimem_jax import storage
from cmimem_jax.storage import write_atomic

__all__ = ["LOCK_FILE", "WorkdirBusy", "WorkdirLock", "path_under",
           "read_jsonl", "rewrite_jsonl", "safe_name", "write_atomic",
           "write_figure", "write_json"]

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def read_jsonl(path: str, repair: bool = True) -> list[dict[str, Any]]:
  """Every record of a JSONL file ([] if it does not exist).

  Args:
    path: the file.
    repair: truncate a torn last line away (with a warning), so later
      appends produce a readable file.

  Raises:
    ValueError: a malformed line before the last one (names file and line).
  """
  target = storage.path(path)
  if not target.exists():
    return []
  data = target.read_bytes()
  repair = repair and not storage.is_remote(path)
  lines = data.split(b"\n")
  records = []
  for number, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      records.append(json.loads(line))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      if number < len(lines):  # Newline-terminated: not a torn write.
        raise ValueError(f"{path}:{number}: malformed record: {e}") from e
      logging.warning("%s: dropping a torn last line of %d bytes (a "
                      "killed writer)", path, len(line))
      if repair:
        with open(path, "r+b") as f:
          f.truncate(len(data) - len(line))
      return records
  if repair and data and not data.endswith(b"\n"):
    # A complete last record without its newline (a write cut after the
    # JSON): terminate it, or the next append would join onto it.
    logging.warning("%s: terminating a last record that lost its newline",
                    path)
    with open(path, "ab") as f:
      f.write(b"\n")
  return records


def write_json(path: str, value: Any, indent: int | None = 1) -> None:
  """`value` as JSON (plus a final newline), written with `write_atomic`."""
  write_atomic(path, json.dumps(value, indent=indent) + "\n")


def write_figure(figure: Any, path: str, dpi: int = 120) -> None:
  """A matplotlib figure as a PNG at `path`, written with `write_atomic`."""
  import io
  buffer = io.BytesIO()
  figure.savefig(buffer, format="png", dpi=dpi)
  write_atomic(path, buffer.getvalue())


def rewrite_jsonl(path: str, records: list[dict[str, Any]]) -> None:
  """Replaces a JSONL file atomically with `records`."""
  write_atomic(path, "".join(json.dumps(r) + "\n" for r in records))


def safe_name(identifier: str) -> str:
  """A file name for an id from a dataset: itself when it is made of
  `[A-Za-z0-9._-]`, at most 64 characters (and not "", "." or ".."), else
  a cleaned prefix plus a hash of the id (distinct ids stay distinct)."""
  if (identifier not in ("", ".", "..") and len(identifier) <= 64
      and not _UNSAFE.search(identifier)):
    return identifier
  digest = hashlib.sha256(identifier.encode()).hexdigest()[:12]
  cleaned = _UNSAFE.sub("_", identifier).strip(".")[:48]
  return f"{cleaned}-{digest}" if cleaned else digest


def path_under(root: str, *names: str) -> str:
  """`root/<safe names...>`, checked to resolve inside `root` (a URL:
  safe names cannot leave it)."""
  path = storage.join(root, *(safe_name(n) for n in names))
  if storage.is_remote(root):
    return path
  real_root = os.path.realpath(root)
  if os.path.commonpath([real_root, os.path.realpath(path)]) != real_root:
    raise ValueError(f"{path} resolves outside {root}")
  return path


LOCK_FILE = ".lock"


class WorkdirBusy(RuntimeError):
  """Another live process writes to the workdir."""


def _process_start(pid: int) -> str | None:
  """The kernel's start time of process `pid` (None: not running, or no
  /proc), which tells a live holder from a reused pid."""
  try:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
      return f.read().rsplit(")", 1)[1].split()[19]
  except (OSError, IndexError):
    return None


def _alive(holder: dict[str, Any]) -> bool:
  pid = holder.get("pid")
  if not isinstance(pid, int):
    return False
  start = _process_start(pid)
  if start is not None:
    return holder.get("start") in (None, start)
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


class WorkdirLock:
  """One writer per workdir: `workdir/.lock` names the holder (pid, host,
  start time, command), created only if absent (local `O_EXCL`, GCS
  `ifGenerationMatch=0`: of two racing writers exactly one takes it). A
  lock left by a dead process on this host is stale and taken over (with a
  warning); a live holder, or one on another host, makes `acquire` raise
  `WorkdirBusy` naming it. On object storage, where a preempted VM's
  successor is another host, the holder refreshes the lock every
  `lease_s / 4` seconds, and a lock of another host untouched for
  `lease_s` is stale too. Re-entrant within a process; released by
  `release` or at exit."""

  # A remote lock's lease: a holder that stopped refreshing it this long
  # ago is gone (a preempted VM).
  LEASE_S = 600.0

  def __init__(self, workdir: str, job: str, lease_s: float = LEASE_S):
    self.workdir, self.job = workdir, job
    self.path = storage.join(workdir, LOCK_FILE)
    self.lease_s = lease_s
    self._held = False
    self._stop_refresh = threading.Event()

  def _mine(self) -> dict[str, Any]:
    import socket
    import sys
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "start": _process_start(os.getpid()), "job": self.job,
            "command": " ".join(sys.argv)[:300]}

  def _holder(self) -> dict[str, Any] | None:
    try:
      return json.loads(storage.path(self.path).read_text())
    except FileNotFoundError:
      return None
    except (ValueError, UnicodeDecodeError):
      return {}  # Torn by a killed writer: nobody holds it.

  def _idle_s(self) -> float:
    """Seconds since the remote lock was last written (0: unknown)."""
    try:
      updated = storage.path(self.path).stat().mtime
    except (FileNotFoundError, OSError):
      return 0.0
    return time.time() - updated

  def _stale(self, holder: dict[str, Any]) -> str | None:
    """Why the lock `holder` wrote is nobody's any more (None: it is)."""
    import socket
    if holder.get("host") == socket.gethostname() and not _alive(holder):
      return f"pid {holder.get('pid')}, no longer running"
    if storage.is_remote(self.path):
      idle = self._idle_s()
      if idle > self.lease_s:
        return (f"on {holder.get('host')}, not refreshed for {idle:.0f} s "
                f"> its lease of {self.lease_s:.0f} s")
    return None

  def acquire(self) -> WorkdirLock:
    import atexit
    storage.makedirs(self.workdir)
    mine = self._mine()
    for _ in range(3):  # A racing writer may replace a stale lock too.
      try:
        storage.create_new(self.path, json.dumps(mine))
      except FileExistsError:
        holder = self._holder()
        if holder is None:
          continue
        same_process = (holder.get("pid") == mine["pid"]
                        and holder.get("host") == mine["host"]
                        and holder.get("start") == mine["start"])
        if same_process:
          return self
        stale = self._stale(holder)
        if stale:
          logging.warning("%s: taking over a stale lock of %s (%s)",
                          self.workdir, holder.get("job", "?"), stale)
          storage.remove(self.path)
          continue
        raise WorkdirBusy(
            f"{self.workdir} is in use by {holder.get('job', '?')} (pid "
            f"{holder.get('pid')} on {holder.get('host')}: "
            f"{holder.get('command', '?')}); wait for it, use another "
            f"workdir, or delete {self.path} if that process is gone")
      self._held = True
      atexit.register(self.release)
      if storage.is_remote(self.path):
        self._stop_refresh.clear()
        threading.Thread(target=self._refresh, args=(json.dumps(mine),),
                         daemon=True, name="workdir-lock").start()
      return self
    raise WorkdirBusy(f"could not take {self.path}")

  def _refresh(self, content: str) -> None:
    """Rewrites the remote lock every `lease_s / 4` s (at least 1 s) while
    it is held; stops, with an error, if another process took it over (this
    one was unreachable for a whole lease)."""
    mine = json.loads(content)
    while not self._stop_refresh.wait(max(self.lease_s / 4, 1.0)):
      try:
        holder = self._holder()
        if holder and any(holder.get(k) != mine[k] for k in ("pid", "host")):
          logging.error("%s: the lock was taken over by %s (pid %s on %s) "
                        "after this process missed its lease; both now "
                        "write to %s", self.path, holder.get("job", "?"),
                        holder.get("pid"), holder.get("host"), self.workdir)
          return
        storage.write_atomic(self.path, content)
      except OSError as e:  # Logged; the next refresh tries again.
        logging.warning("%s: could not refresh the lock: %s", self.path, e)

  def release(self) -> None:
    """Removes the lock if this process holds it."""
    if not self._held:
      return
    self._held = False
    self._stop_refresh.set()
    try:
      holder, mine = self._holder(), self._mine()
      if holder and all(holder.get(k) == mine[k] for k in ("pid", "host")):
        storage.remove(self.path)
    except (OSError, RuntimeError) as e:  # E.g. the bucket unreachable.
      logging.warning("%s: could not release the lock (%s); the next run "
                      "takes it over once its holder is gone", self.path, e)

  def __enter__(self) -> WorkdirLock:
    return self.acquire()

  def __exit__(self, *exc: object) -> None:
    self.release()
