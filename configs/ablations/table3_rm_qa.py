"""Table 3 "+RM+QA": GRPO on the QA reward alone, retrieval-indexed memory."""

import ml_collections

from configs import qwen3_4b_tpu
from configs.ablations import derive

PAPER_ROW = ("table3", "+RM+QA")  # tools/compare_paper.py
BASE = qwen3_4b_tpu
CHANGES = {"reward.alpha": 0.0}


def get_config() -> ml_collections.ConfigDict:
  return derive(CHANGES, BASE)
