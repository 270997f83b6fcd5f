"""Table 3 "+QA": GRPO on the QA reward alone, flat memory."""

import ml_collections

from configs import qwen3_4b_tpu
from configs.ablations import FLAT_MEMORY, derive

PAPER_ROW = ("table3", "+QA")  # tools/compare_paper.py
BASE = qwen3_4b_tpu
CHANGES = {"reward.alpha": 0.0, **FLAT_MEMORY}


def get_config() -> ml_collections.ConfigDict:
  return derive(CHANGES, BASE)
