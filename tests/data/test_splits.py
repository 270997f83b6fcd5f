"""LongMemEval's official partitions (Table 5), bundled as question ids."""

import pytest

from cmimem_jax.config import unchecked
from cmimem_jax.data import (LONGMEMEVAL_SPLITS, configured_split,
                             load_dataset, longmemeval_split_ids)
from cmimem_jax.data.registry import DatasetConfig


def test_bundled_split_ids_match_table_5():
  sizes = {s: len(longmemeval_split_ids(s)) for s in LONGMEMEVAL_SPLITS}
  assert sizes == {"sft": 50, "rl": 50, "test": 400}
  assert not (longmemeval_split_ids("rl") & longmemeval_split_ids("test"))
  with pytest.raises(ValueError, match="unknown LongMemEval split"):
    longmemeval_split_ids("train")


def test_split_selection(longmemeval_sample_path, locomo_path):
  every = load_dataset("longmemeval", longmemeval_sample_path)
  test = load_dataset("longmemeval", longmemeval_sample_path, "test")
  assert [d.dialogue_id for d in test] == [d.dialogue_id for d in every] == [
      "6a1eabeb", "gpt4_70e84552_abs"]
  with pytest.raises(ValueError, match="no dialogue .* 'rl' split"):
    load_dataset("longmemeval", longmemeval_sample_path, "rl")
  with pytest.raises(ValueError, match="only LongMemEval"):
    load_dataset("locomo", locomo_path, "test")


def _Section(name: str, split: str = "") -> DatasetConfig:
  return unchecked(DatasetConfig, name=name, path="", split=split)


def test_defaults_per_job():
  lme, locomo = _Section(name="longmemeval"), _Section(name="locomo")
  assert configured_split(lme, "evaluate") == "test"  # The paper's protocol.
  assert configured_split(lme, "train") == "all"
  assert configured_split(locomo, "evaluate") == "all"
  assert configured_split(_Section(name="longmemeval", split="rl"),
                          "evaluate") == "rl"
