"""Table 3 "+RM": the base policy prompted, retrieval-indexed memory, no GRPO."""

import ml_collections

from configs import eval_qwen3_4b
from configs.ablations import PROMPTING, derive

PAPER_ROW = ("table3", "+RM")  # tools/compare_paper.py
BASE = eval_qwen3_4b
CHANGES = PROMPTING


def get_config() -> ml_collections.ConfigDict:
  return derive(CHANGES, BASE)
