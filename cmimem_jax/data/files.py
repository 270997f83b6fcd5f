"""Files the jobs write and read back: JSONL logs that survive a hard kill,
and ids from dataset files turned into safe directory names.

A process killed mid-write leaves at most one torn (unterminated) line at
the end of an append-only JSONL file; `read_jsonl` drops it and truncates
the file back to its last complete line (or, when only the newline was
lost, terminates the record), so the next append starts clean.
A malformed line anywhere else is real corruption and raises.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Any

from absl import logging

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
  if not os.path.exists(path):
    return []
  with open(path, "rb") as f:
    data = f.read()
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


def write_atomic(path: str, data: str | bytes) -> None:
  """Replaces the file `path` with `data` (a str is written as UTF-8) in
  one step: readers see the old file or the whole new one, never a part.

  The data goes to a temporary file in the same directory (same file
  system, so the rename is atomic), is fsync'ed, then renamed over `path`
  (`os.replace`); the directory is fsync'ed so the rename survives a
  crash. If anything fails (a full disk, say) the temporary file is
  removed, `path` is left as it was, and the error is raised.
  """
  import tempfile
  payload = data.encode("utf-8") if isinstance(data, str) else data
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  fd, staging = tempfile.mkstemp(
      dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(payload)
      f.flush()
      os.fsync(f.fileno())
    # mkstemp makes the file 0600; a result file is for others to read.
    os.chmod(staging, 0o644)
    os.replace(staging, path)
  except BaseException:
    try:
      os.remove(staging)
    except FileNotFoundError:
      pass
    raise
  try:
    directory_fd = os.open(directory, os.O_RDONLY)
  except OSError:  # E.g. a platform without directory descriptors.
    return
  try:
    os.fsync(directory_fd)
  except OSError:
    pass
  finally:
    os.close(directory_fd)


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
  """`root/<safe names...>`, checked to resolve inside `root`."""
  path = os.path.join(root, *(safe_name(n) for n in names))
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
  start time, command). A lock left by a dead process on this host is
  stale and taken over (with a warning); a live holder, or one on another
  host (which cannot be checked), makes `acquire` raise `WorkdirBusy`
  naming it. Re-entrant within a process; released by `release` or at
  exit."""

  def __init__(self, workdir: str, job: str):
    self.workdir, self.job = workdir, job
    self.path = os.path.join(workdir, LOCK_FILE)
    self._held = False

  def _mine(self) -> dict[str, Any]:
    import socket
    import sys
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "start": _process_start(os.getpid()), "job": self.job,
            "command": " ".join(sys.argv)[:300]}

  def _holder(self) -> dict[str, Any] | None:
    try:
      with open(self.path, encoding="utf-8") as f:
        return json.load(f)
    except FileNotFoundError:
      return None
    except (OSError, json.JSONDecodeError):
      return {}  # Torn by a killed writer: nobody holds it.

  def acquire(self) -> WorkdirLock:
    import atexit
    import socket
    os.makedirs(self.workdir, exist_ok=True)
    mine = self._mine()
    for _ in range(3):  # A racing writer may replace a stale lock too.
      try:
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
      except FileExistsError:
        holder = self._holder()
        if holder is None:
          continue
        same_process = (holder.get("pid") == mine["pid"]
                        and holder.get("host") == mine["host"]
                        and holder.get("start") == mine["start"])
        if same_process:
          return self
        if holder.get("host") == socket.gethostname() and not _alive(holder):
          logging.warning("%s: taking over a stale lock of %s (pid %s, no "
                          "longer running)", self.workdir,
                          holder.get("job", "?"), holder.get("pid"))
          try:
            os.remove(self.path)
          except FileNotFoundError:
            pass
          continue
        raise WorkdirBusy(
            f"{self.workdir} is in use by {holder.get('job', '?')} (pid "
            f"{holder.get('pid')} on {holder.get('host')}: "
            f"{holder.get('command', '?')}); wait for it, use another "
            f"workdir, or delete {self.path} if that process is gone")
      with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(mine, f)
      self._held = True
      atexit.register(self.release)
      return self
    raise WorkdirBusy(f"could not take {self.path}")

  def release(self) -> None:
    """Removes the lock if this process holds it."""
    if not self._held:
      return
    self._held = False
    holder = self._holder()
    if holder and holder.get("pid") == os.getpid():
      try:
        os.remove(self.path)
      except FileNotFoundError:
        pass

  def __enter__(self) -> WorkdirLock:
    return self.acquire()

  def __exit__(self, *exc: object) -> None:
    self.release()
