"""Shared fixtures. Fakes an 8-device CPU mesh before JAX is imported."""

import os

# Appended, not set-if-absent: a user's own XLA_FLAGS must not silently
# turn the multi-device tests into single-device ones.
_DEVICES = "--xla_force_host_platform_device_count=8"
if _DEVICES not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICES}"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

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
  """Counts XLA backend compilations in this process (every jit program,
  ours and JAX's own), via JAX's monitoring events."""

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
