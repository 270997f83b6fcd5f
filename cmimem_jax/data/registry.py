"""Loads a dataset named by a `dataset` config section."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Iterator
from typing import ClassVar

from cmimem_jax.config import Section, location_problem, need
from cmimem_jax.data.locomo import load_locomo
from cmimem_jax.data.longmemeval import load_longmemeval
from cmimem_jax.data.memoryagentbench import load_memoryagentbench
from cmimem_jax.data.types import Dialogue

LOADERS = {
    "locomo": load_locomo,
    "longmemeval": load_longmemeval,
    "memoryagentbench": load_memoryagentbench,
}


# LongMemEval's official question-id partitions (Table 5: 50 SFT, 50 RL,
# 400 test), bundled as `longmemeval_splits.json`.
LONGMEMEVAL_SPLITS = ("sft", "rl", "test")


@functools.cache
def longmemeval_split_ids(split: str) -> frozenset[str]:
  """The question ids of one LongMemEval split."""
  if split not in LONGMEMEVAL_SPLITS:
    raise ValueError(f"unknown LongMemEval split {split!r}; known: "
                     f"{LONGMEMEVAL_SPLITS}")
  with open(bundled_path("longmemeval_splits.json")) as f:
    return frozenset(json.load(f)[split])


def default_split(name: str, job: str) -> str:
  """`dataset.split=""`: evaluation of LongMemEval reads its 400-question
  test split (the paper's protocol); everything else reads the whole file."""
  return "test" if name == "longmemeval" and job == "evaluate" else "all"


# "" = the job's default (`default_split`); the others are LongMemEval's
# official partitions.
DATASET_SPLITS = ("", "all") + LONGMEMEVAL_SPLITS


@dataclasses.dataclass(frozen=True)
class DatasetConfig(Section):
  """The `dataset` section: which benchmark file a job reads."""

  SECTION: ClassVar[str] = "dataset"

  name: str
  path: str
  split: str = ""     # One of DATASET_SPLITS ("": the job's default).
  dialogues: int = 0  # The first N dialogues (0: all).
  start: int = 0      # Evaluation: skip the first N dialogues.

  def invalid(self) -> Iterator[str]:
    yield from need(self, "name", lambda v: v in LOADERS,
                    f"one of {tuple(LOADERS)}")
    problem = location_problem(
        "path", self.path, "an existing file (see docs/design.md#data for "
        "where the benchmarks live)")
    if problem:
      yield problem
    yield from need(self, "split", lambda v: v in DATASET_SPLITS,
                    f"one of {DATASET_SPLITS} ('': the job's default)")
    if self.split not in ("", "all") and self.name != "longmemeval":
      yield f"split={self.split!r}: only LongMemEval has splits"
    for key in ("dialogues", "start"):
      yield from need(self, key, lambda v: v >= 0, ">= 0")


def configured_split(dataset: DatasetConfig, job: str) -> str:
  """The split a `dataset` config section selects for `job`."""
  return dataset.split or default_split(dataset.name, job)


def load_configured(dataset: DatasetConfig, job: str) -> list[Dialogue]:
  """The dialogues a `dataset` config section names (`name`, `path`,
  `split`) for `job` ("train", "evaluate", "build_memory")."""
  return load_dataset(dataset.name, dataset.path, configured_split(dataset, job))


def load_dataset(name: str, path: str, split: str = "all") -> list[Dialogue]:
  """Dispatches to `load_<name>(path)`; `split` (LongMemEval only) keeps
  the dialogues whose question id is in that split.

  Raises:
    ValueError: unknown dataset or split, a split of another dataset, or a
      split no dialogue of the file belongs to.
  """
  if name not in LOADERS:
    raise ValueError(f"unknown dataset {name!r}; known: {sorted(LOADERS)}")
  dialogues = LOADERS[name](path)
  if split == "all":
    return dialogues
  if name != "longmemeval":
    raise ValueError(f"dataset.split={split!r}: only LongMemEval has splits")
  ids = longmemeval_split_ids(split)
  kept = [d for d in dialogues if d.dialogue_id in ids]
  if not kept:
    raise ValueError(f"no dialogue of {path} is in the LongMemEval {split!r} "
                     "split (set dataset.split='all' to read the whole file)")
  return kept


def bundled_path(name: str = "longmemeval_train_sample.json") -> str:
  """A dataset file shipped inside the package (`cmimem_jax/data/bundled`).

  `longmemeval_train_sample.json`: our own small training set (6 users,
  15 short sessions, 42 per-session QA pairs) in LongMemEval format with
  the `session_qa` extension, written for the CPU configs.
  `longmemeval_train_with_filler.json`: the same with two sessions per
  user (ids `<user>_f1`, `<user>_f2`) in which the user only asks
  common-knowledge questions, like the filler sessions (ShareGPT /
  UltraChat requests) that make up most of LongMemEval's haystacks: there
  a semantic SKIP is right (App. B). Each has 2 QA pairs on what was asked
  or answered there (27 sessions, 66 QA pairs).
  """
  return os.path.join(os.path.dirname(__file__), "bundled", name)
