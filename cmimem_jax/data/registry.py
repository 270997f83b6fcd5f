"""Loads a dataset named by a `dataset` config section."""

from __future__ import annotations

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
