"""Shared fixtures. Fakes an 8-device CPU mesh before JAX is imported."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pathlib  # noqa: E402

import pytest  # noqa: E402

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
