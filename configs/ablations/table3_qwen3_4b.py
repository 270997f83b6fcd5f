"""Table 3 "Qwen3-4B": the base policy prompted, flat memory, no GRPO."""

import ml_collections

from configs.ablations import FLAT_MEMORY, PROMPTING_ONLY, derive

PAPER_ROW = ("table3", "Qwen3-4B")  # tools/compare_paper.py
CHANGES = {**PROMPTING_ONLY, **FLAT_MEMORY}


def get_config() -> ml_collections.ConfigDict:
  return derive(CHANGES)
