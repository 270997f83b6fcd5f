"""Table 3 / Table 9 "CMI-Mem (full)": the base config itself."""

import ml_collections

from configs import qwen3_4b_tpu
from configs.ablations import derive

PAPER_ROW = ("table3", "CMI-Mem (full)")  # tools/compare_paper.py
BASE = qwen3_4b_tpu
CHANGES = {}


def get_config() -> ml_collections.ConfigDict:
  return derive(CHANGES, BASE)
