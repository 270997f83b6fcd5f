"""Table 9 "w/o Gaussian": raw per-operation scores, no Eq. 11 shaping."""

import ml_collections

from configs import qwen3_4b_tpu
from configs.ablations import derive

PAPER_ROW = ("table9", "w/o Gaussian")  # tools/compare_paper.py
BASE = qwen3_4b_tpu
CHANGES = {"reward.shaping": "none"}


def get_config() -> ml_collections.ConfigDict:
  return derive(CHANGES, BASE)
