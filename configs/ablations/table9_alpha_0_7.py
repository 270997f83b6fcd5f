"""Table 9 "alpha=0.7"."""

import ml_collections

from configs import qwen3_4b_tpu
from configs.ablations import derive

PAPER_ROW = ("table9", "alpha=0.7")  # tools/compare_paper.py
BASE = qwen3_4b_tpu
CHANGES = {"reward.alpha": 0.7}


def get_config() -> ml_collections.ConfigDict:
  return derive(CHANGES, BASE)
