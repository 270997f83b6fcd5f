"""Shared fixtures. Fakes an 8-device CPU mesh before JAX is imported."""

import atexit
import os
import shutil
import tempfile

# Appended, not set-if-absent: a user's own XLA_FLAGS must not silently
# turn the multi-device tests into single-device ones.
_DEVICES = "--xla_force_host_platform_device_count=8"
# The suite compiles ~2,000 small programs and runs each a few times, so
# compiling is half its time: XLA:CPU's loop emitters and LLVM -O1 compile
# them 2.4x faster (a tiny training run: 34 s -> 14 s) and run them as
# fast. Same HLO, same math; the commands the tests start inherit these
# (tools/bench.py's too: its test checks agreement, not timings; the
# numbers in BENCHMARKS.md come from the tool run as written there).
_FAST_COMPILE = ("--xla_cpu_use_fusion_emitters=false",
                 "--xla_backend_optimization_level=1")
_xla_flags = os.environ.get("XLA_FLAGS", "")
if _DEVICES not in _xla_flags:
  _xla_flags += f" {_DEVICES}"
for _flag in _FAST_COMPILE:  # A user's own setting of these wins.
  if _flag.split("=")[0] not in _xla_flags:
    _xla_flags += f" {_flag}"
os.environ["XLA_FLAGS"] = _xla_flags.strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Converted tokenizers (`params.load_gguf_tokenizer`) and compiled programs
# are shared by this session's tests and the commands they start, not by
# the user's caches. Many tests build a tiny trainer of one config, each
# with fresh jit objects, and the CLI tests start processes that compile
# the same programs again: JAX's persistent cache turns those repeats into
# loads (a one-step trainer: 57-70 s -> 30 s on a busy 2-core host). Every
# program is cached, however fast it compiled. Under pytest-xdist
# (`make test`) the controller makes the directories before its workers
# start; the workers inherit them, so one worker loads what the other
# compiled, and only the controller removes them.
_SESSION_DIRS = {"CMIMEM_CACHE_DIR": "cmimem-tests-cache-",
                 "JAX_COMPILATION_CACHE_DIR": "cmimem-tests-xla-"}
if "PYTEST_XDIST_WORKER" not in os.environ:
  for _variable, _prefix in _SESSION_DIRS.items():
    os.environ[_variable] = tempfile.mkdtemp(prefix=_prefix)
    atexit.register(shutil.rmtree, os.environ[_variable], True)
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"

import pathlib  # noqa: E402
import threading  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

if jax.default_backend() == "cpu" and len(jax.devices()) != 8:
  raise RuntimeError(
      f"the tests need 8 fake CPU devices, found {len(jax.devices())}: JAX was"
      f" initialised before tests/conftest.py set XLA_FLAGS ({_DEVICES})")

from cmimem_jax.encoders import HashingEncoder  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"
LOCOMO = SHARED_DATA / "locomo" / "locomo10.json"
LONGMEMEVAL_SAMPLE = SHARED_DATA / "longmemeval" / "longmemeval_oracle_2q_sample.json"
LONGMEMEVAL_SPLITS = SHARED_DATA / "longmemeval" / "longmemeval_splits.json"


def _require(path: pathlib.Path) -> str:
  if not path.exists():
    pytest.skip(f"{path} not found: the real benchmark data lives in the "
                "project's shared/ folder next to the checkout (CI has it)")
  return str(path)


@pytest.fixture
def own_devices_env() -> dict[str, str]:
  """The environment for a command that sets its own device count: this
  session's XLA_FLAGS (its fast compile) without the 8 fake devices."""
  flags = [flag for flag in os.environ["XLA_FLAGS"].split()
           if not flag.startswith(_DEVICES.split("=")[0])]
  return dict(os.environ, XLA_FLAGS=" ".join(flags))


@pytest.fixture(scope="session")
def locomo_path() -> str:
  return _require(LOCOMO)


@pytest.fixture(scope="session")
def longmemeval_sample_path() -> str:
  return _require(LONGMEMEVAL_SAMPLE)


@pytest.fixture(scope="session")
def locomo_dialogues(locomo_path):
  from cmimem_jax.data import load_locomo
  return load_locomo(locomo_path)


@pytest.fixture
def encoder() -> HashingEncoder:
  return HashingEncoder(dim=128)


class CompileCounter:
  """Counts the programs this process compiles or loads from the persistent
  cache (every jit program, ours and JAX's own: each is a miss of JAX's
  in-memory cache), via JAX's monitoring events: JAX records the backend
  compile event for a persistent-cache load too (measured: a second
  process loading 3 cached programs counts 3)."""

  EVENT = "/jax/core/compile/backend_compile_duration"

  def __init__(self):
    self._lock = threading.Lock()
    self.count = 0
    jax.monitoring.register_event_duration_secs_listener(self._on_event)

  def _on_event(self, event: str, duration: float, **kwargs) -> None:
    del duration, kwargs
    if event == self.EVENT:
      with self._lock:
        self.count += 1


_COMPILES = CompileCounter()


@pytest.fixture
def compiles() -> CompileCounter:
  """The process-wide compile counter: compare `.count` before and after."""
  return _COMPILES


@pytest.fixture(scope="session")
def gcs(tmp_path_factory):
  """One GCS emulator (`cmimem_jax.testing.gcs_emulator`) per test session
  (worker), `STORAGE_EMULATOR_HOST` pointing at it; tests make their own
  buckets."""
  from cmimem_jax.testing.gcs_emulator import GcsEmulator
  emulator = GcsEmulator(str(tmp_path_factory.mktemp("gcs")))
  emulator.use()
  yield emulator
  emulator.stop()
