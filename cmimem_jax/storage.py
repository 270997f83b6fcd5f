"""Where a run's files live: one path layer for local paths and object
storage (`gs://bucket/dir`), over `etils.epath` (the path library Orbax
uses) with `gcsfs` for Google Cloud Storage, the `gcs` extra
(`pip install -e ".[gcs]"`).

Every file a job reads or writes goes through `path()` (an `epath.Path`,
checked once per bucket: a scheme nobody handles, a missing client, an
unreachable endpoint or a bucket that does not exist is one `StorageError`
line, before anything is written) and the three writers below. Local
paths behave as POSIX files always did; object storage has no appends, no
renames and no partial objects, so each writer says what it does there:

- `write_atomic`: local, a temp file in the same directory + fsync +
  `os.replace`; on object storage one whole-object upload (readers see the
  old object or the new one, never a part).
- `Appender` (metrics.jsonl, rollouts.jsonl, predictions.jsonl,
  TensorBoard events): local, an append-mode file; on object storage each
  `flush` uploads the bytes written since the last one as a side object
  and composes [object, side] into the object (GCS `compose`, server
  side: a flush sends the new bytes, never the whole file). Flushed as
  often as the local file is (every record), a preempted run loses what a
  killed local run loses, and the resume rule of its readers is the same.
  Not one object per step: every reader (skip_report, the summaries,
  TensorBoard) keeps reading one file. Not a local spool uploaded at each
  checkpoint: the job would write to the VM's disk, and the bucket would
  lag the run by up to a checkpoint interval for whoever reads it. Cost:
  three requests per flush.
- `create_new`: local `O_EXCL`; on GCS an upload with the precondition
  `ifGenerationMatch=0` (create only if absent): the workdir lock.

`STORAGE_EMULATOR_HOST` (a GCS emulator: fake-gcs-server in the tests)
routes every client to it: gcsfs reads it itself (anonymously, without
its zonal-bucket probe, a gRPC call no emulator answers), and tensorstore,
which writes Orbax's arrays through its own GCS driver, gets
`TENSORSTORE_GCS_HTTP_URL` and a fixed token.

Layer 0: imports nothing of the package.
"""

from __future__ import annotations

import os
import re
import socket
import tempfile
import threading
import urllib.parse
from typing import IO, Any

from etils import epath

# The schemes a path may have, with the module that serves each and the
# install hint when it is missing.
SCHEMES = {"gs": ("gcsfs", 'pip install -e ".[gcs]" (or pip install gcsfs)')}
_SUPPORTED = "local paths and gs://bucket/..."
EMULATOR_ENV = "STORAGE_EMULATOR_HOST"
# GCS refuses a composite object of more than 1024 components: an appended
# object is rewritten whole (one component again) before it gets there.
_MAX_COMPONENTS = 1000
# A GCS bucket name: 3-63 lowercase letters, digits, dashes, underscores
# and dots (222 with dots), starting and ending with a letter or digit
# (tensorstore, Orbax's array writer, refuses any other).
_BUCKET = re.compile(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]")
_SCHEME_NAME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")
# Schemes whose mangled URLs (`gs:bucket/x`) are refused, not taken for a
# local directory with a colon in its name.
_KNOWN_SCHEMES = ("gs", "gcs", "s3", "az", "hf", "http", "https", "file")


class StorageError(OSError):
  """A location that cannot be used: the message is one line saying what
  to do (an `OSError`: entry points print it and exit 1)."""


PathLike = str | os.PathLike


def is_remote(location: PathLike) -> bool:
  """Whether `location` is a URL (`scheme://...`), not a local path."""
  return "://" in os.fspath(location)


def check_location(location: PathLike) -> str:
  """`location` as a string, refused (`StorageError`) when it is a URL of
  a scheme nobody handles (`s3://`, `gcs://`), a bucket name GCS would
  refuse, or a mangled URL that would otherwise become a local directory
  named after the scheme (`gs:/x`, `gs:bucket`)."""
  text = os.fspath(location)
  if "://" in text:
    scheme, rest = text.split("://", 1)
    if scheme not in SCHEMES:
      hint = " (did you mean gs://?)" if scheme in ("gcs", "gcp") else ""
      raise StorageError(f"{text}: unsupported scheme {scheme}://{hint}; "
                         f"use {_SUPPORTED}")
    bucket = rest.split("/", 1)[0]
    if not _BUCKET.fullmatch(bucket):
      raise StorageError(f"{text}: {bucket!r} is not a GCS bucket name "
                         "(3-63 lowercase letters, digits, '-', '_' or '.')"
                         )
    return text
  first = text.split("/", 1)[0]
  scheme = first.split(":", 1)[0]
  if (first.endswith(":") and _SCHEME_NAME.fullmatch(scheme)) or (
      ":" in first and scheme.lower() in _KNOWN_SCHEMES):
    raise StorageError(f"{text}: looks like a {scheme}:// URL missing a "
                       f"slash (it would be a local directory named "
                       f"'{first}'); use {_SUPPORTED}")
  return text


def configure_clients() -> None:
  """Points every GCS client at `STORAGE_EMULATOR_HOST` when it is set (a
  user's own setting of any variable wins; called before every first use
  of a bucket), and turns gcsfs's listing cache off in every instance
  (ours and the one `etils.epath`, hence Orbax, makes): a workdir's objects
  change under another process (a trainer writing while a report reads),
  and Orbax's arrays arrive through tensorstore, unseen by gcsfs."""
  import fsspec
  fsspec.config.conf.setdefault("gcs", {}).setdefault("use_listings_cache",
                                                      False)
  host = os.environ.get(EMULATOR_ENV, "")
  if host in ("", "default"):
    return
  url = host if host.startswith(("http://", "https://")) else f"http://{host}"
  os.environ.setdefault("TENSORSTORE_GCS_HTTP_URL", url)
  os.environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")
  os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
  fsspec.config.conf["gcs"].setdefault("token", "anon")


def _require_client(scheme: str) -> None:
  """`StorageError` with the install hint when `scheme`'s client is not
  installed."""
  module, hint = SCHEMES[scheme]
  configure_clients()
  try:
    __import__(module)
  except ImportError:
    raise StorageError(f"{scheme}:// paths need {module}, which is not "
                       f"installed: {hint}") from None


def filesystem(scheme: str = "gs") -> Any:
  """The fsspec filesystem of `scheme` (its client checked first)."""
  _require_client(scheme)
  import fsspec
  return fsspec.filesystem("gcs" if scheme == "gs" else scheme)


_checked: set[str] = set()
_checked_lock = threading.Lock()


def _preflight(location: str) -> None:
  """Once per bucket and process: its endpoint answers and it exists.
  Nothing is written (a bucket that refuses writes says so at the first
  write: the workdir lock)."""
  scheme, rest = location.split("://", 1)
  bucket = rest.split("/", 1)[0]
  key = f"{scheme}://{bucket}"
  with _checked_lock:
    if key in _checked:
      return
  _require_client(scheme)
  # Where gcsfs will send its requests (the emulator's, if set), asked
  # before it looks for credentials (seconds where there are none).
  from gcsfs.core import _location
  url = _location()
  parsed = urllib.parse.urlsplit(url)
  try:
    socket.create_connection((parsed.hostname, parsed.port or (
        443 if parsed.scheme == "https" else 80)), timeout=10).close()
  except OSError as e:
    where = (f"the GCS emulator at {url} ({EMULATOR_ENV})"
             if os.environ.get(EMULATOR_ENV) else url)
    raise StorageError(f"{location}: cannot reach {where}: {e}") from None
  fs = filesystem(scheme)
  try:
    fs.call("GET", f"b/{bucket}", json_out=True)
  except FileNotFoundError:
    raise StorageError(f"{location}: bucket {key} does not exist (or these "
                       f"credentials cannot see it); create it first: "
                       f"gcloud storage buckets create {key}") from None
  except Exception as e:  # noqa: BLE001 - any client error, in one line.
    # 403: credentials with object access only (no storage.buckets.get)
    # may still read and write it; the first access says if not.
    if "Forbidden" not in str(e):
      raise StorageError(f"{location}: cannot read bucket {key}: "
                         f"{_one_line(e)}") from None
  with _checked_lock:
    _checked.add(key)


def _one_line(error: BaseException) -> str:
  return " ".join(f"{type(error).__name__}: {error}".split())[:300]


def path(location: PathLike) -> epath.Path:
  """`location` as an `epath.Path`, after `check_location` and, for a
  URL, a check that its client is installed and its bucket exists."""
  text = check_location(location)
  if is_remote(text):
    _preflight(text)
  return epath.Path(text)


def require_local(location: str, setting: str) -> str:
  """`location` if it is a local path; a URL is refused (`StorageError`)
  for what only reads local files (model weights and tokenizers, which
  safetensors, llama.cpp's GGUF reader and transformers open by name)."""
  if location and is_remote(location):
    raise StorageError(f"{setting}={location}: model files are read from "
                       f"local disk; copy them there first (gcloud storage "
                       f"cp -r {location} DIR) and name DIR")
  return location


def join(location: PathLike, *names: str) -> str:
  """`location/names...` as a string, a URL kept a URL."""
  return os.path.join(os.fspath(location), *names)


def makedirs(location: PathLike) -> None:
  """Creates a local directory (and its parents); nothing on object
  storage, which has no directories (and where gcsfs would create a
  missing *bucket*)."""
  location = path(location)
  if not is_remote(location):
    os.makedirs(location, exist_ok=True)


def _remote_error(location: str, error: Exception) -> StorageError:
  """A client's failure to write `location` as one line with what to do."""
  text = str(error)
  if "Forbidden" in text or "403" in text:
    return StorageError(
        f"{location}: the bucket refuses writes ({_one_line(error)}); use "
        "credentials with storage.objects.create there, or another bucket")
  return StorageError(f"{location}: write failed: {_one_line(error)}")


def write_atomic(location: PathLike, data: str | bytes) -> None:
  """Replaces the file `location` with `data` (str: UTF-8) atomically: a
  reader, or a run killed mid-write, sees the old content or the new,
  never a part. Local: a temp file in the same directory, fsync, then
  `os.replace`; object storage: one whole-object upload."""
  blob = data.encode("utf-8") if isinstance(data, str) else data
  location = os.fspath(path(location))
  if is_remote(location):
    try:
      filesystem().pipe_file(location, blob)
    except StorageError:
      raise
    except Exception as e:  # noqa: BLE001 - any client error, in one line.
      raise _remote_error(location, e) from e
    return
  _write_local_atomic(location, blob)


def _write_local_atomic(location: str, blob: bytes) -> None:
  """A temp file in the same directory (same file system, so the rename is
  atomic), fsync'ed, renamed over `location` (`os.replace`), then the
  directory fsync'ed so the rename survives a crash. On any failure (a
  full disk, say) the temp file is removed, `location` is left as it was,
  and the error is raised."""
  directory = os.path.dirname(os.path.abspath(location))
  os.makedirs(directory, exist_ok=True)
  fd, staging = tempfile.mkstemp(
      dir=directory, prefix=f".{os.path.basename(location)}.", suffix=".tmp")
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(blob)
      f.flush()
      os.fsync(f.fileno())
    # mkstemp makes the file 0600; a result file is for others to read.
    os.chmod(staging, 0o644)
    os.replace(staging, location)
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


def create_new(location: PathLike, data: str | bytes) -> None:
  """Writes `location` only if it does not exist (raises
  `FileExistsError` if it does): local `O_EXCL`, GCS `ifGenerationMatch=0`.
  Two processes racing for it: exactly one succeeds."""
  blob = data.encode("utf-8") if isinstance(data, str) else data
  location = os.fspath(path(location))
  if is_remote(location):
    try:
      filesystem().pipe_file(location, blob, mode="create")
    except FileExistsError:
      raise
    except Exception as e:  # noqa: BLE001 - any client error, in one line.
      raise _remote_error(location, e) from e
    return
  fd = os.open(location, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
  with os.fdopen(fd, "wb") as f:
    f.write(blob)


def remove(location: PathLike) -> None:
  """Deletes a file (nothing if it is gone already)."""
  target = path(location)
  try:
    target.unlink()
  except FileNotFoundError:
    pass


class Appender:
  """A file opened for appending (`mode` "a": str, "ab": bytes); `flush`
  makes what was written since durable. Local: an append-mode file.
  Object storage: `flush` appends the pending bytes to the object by
  composing it with a side object `<name>.append` (one writer per object:
  the workdir lock), and rewrites it whole when it nears GCS's limit of
  composed components."""

  def __init__(self, location: PathLike, mode: str = "a"):
    if mode not in ("a", "ab"):
      raise ValueError(f"mode must be 'a' or 'ab', got {mode!r}")
    self.location = os.fspath(path(location))
    self._text = mode == "a"
    self._file: IO[Any] | None = None
    self._pending: list[bytes] = []
    # TensorBoard flushes from its own thread while the step writes.
    self._lock = threading.Lock()
    self.closed = False
    if not is_remote(self.location):
      self._file = open(self.location, mode,
                        **({"encoding": "utf-8"} if self._text else {}))
      return
    self._fs = filesystem()
    try:
      info = self._fs.info(self.location)
      self._exists = True
      self._components = int(info.get("componentCount") or 1)
    except FileNotFoundError:
      self._exists, self._components = False, 0

  def write(self, data: str | bytes) -> None:
    if self._file is not None:
      self._file.write(data)
      return
    with self._lock:
      self._pending.append(data.encode("utf-8") if isinstance(data, str)
                           else data)

  def flush(self) -> None:
    if self._file is not None:
      self._file.flush()
      return
    with self._lock:
      self._append_pending()

  def _append_pending(self) -> None:
    if not self._pending:
      return
    blob = b"".join(self._pending)
    try:
      if not self._exists or self._components >= _MAX_COMPONENTS:
        if self._exists:  # Whole again: one component.
          blob = self._fs.cat_file(self.location) + blob
        self._fs.pipe_file(self.location, blob)
        self._exists, self._components = True, 1
      else:
        side = f"{self.location}.append"
        self._fs.pipe_file(side, blob)
        self._fs.merge(self.location, [self.location, side])
        self._fs.rm_file(side)
        self._components += 1
    except Exception as e:  # noqa: BLE001 - any client error, in one line.
      raise _remote_error(self.location, e) from e
    self._pending.clear()

  def close(self) -> None:
    """Flushes and closes. A local file is closed even when its flush
    fails (a full disk): its buffered tail is dropped, never written
    later (`MetricsWriter.truncate_after` cuts the file after this)."""
    if self.closed:
      return
    self.closed = True
    try:
      self.flush()
    finally:
      if self._file is not None:
        self._file.close()  # Closes the descriptor even if it raises.

  def __enter__(self) -> Appender:
    return self

  def __exit__(self, *exc: object) -> None:
    self.close()

