"""Table 3 "+RM": the base policy prompted, retrieval-indexed memory, no GRPO."""

import ml_collections

from configs.ablations import PROMPTING_ONLY, derive

PAPER_ROW = ("table3", "+RM")  # tools/compare_paper.py
CHANGES = PROMPTING_ONLY


def get_config() -> ml_collections.ConfigDict:
  return derive(CHANGES)
