"""Table 3 "Qwen3-4B": the base policy prompted, flat memory, no GRPO."""

import ml_collections

from configs import eval_qwen3_4b
from configs.ablations import FLAT_MEMORY, PROMPTING, derive

PAPER_ROW = ("table3", "Qwen3-4B")  # tools/compare_paper.py
BASE = eval_qwen3_4b
CHANGES = {**PROMPTING, **FLAT_MEMORY}


def get_config() -> ml_collections.ConfigDict:
  return derive(CHANGES, BASE)
