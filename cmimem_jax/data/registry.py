"""Loads a dataset named by a `dataset` config section."""

from __future__ import annotations

import os

from cmimem_jax.data.locomo import load_locomo
from cmimem_jax.data.longmemeval import load_longmemeval
from cmimem_jax.data.memoryagentbench import load_memoryagentbench
from cmimem_jax.data.types import Dialogue

LOADERS = {
    "locomo": load_locomo,
    "longmemeval": load_longmemeval,
    "memoryagentbench": load_memoryagentbench,
}


def load_dataset(name: str, path: str) -> list[Dialogue]:
  """Dispatches to `load_<name>(path)`."""
  if name not in LOADERS:
    raise ValueError(f"unknown dataset {name!r}; known: {sorted(LOADERS)}")
  return LOADERS[name](path)


def bundled_path(name: str = "longmemeval_train_sample.json") -> str:
  """A dataset file shipped inside the package (`cmimem_jax/data/bundled`).

  `longmemeval_train_sample.json`: our own small training set (6 users,
  15 short sessions, 42 per-session QA pairs) in LongMemEval format with
  the `session_qa` extension, written for the CPU configs.
  """
  return os.path.join(os.path.dirname(__file__), "bundled", name)
