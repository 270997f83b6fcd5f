"""Table 9 "alpha=0.5"."""

import ml_collections

from configs.ablations import derive

PAPER_ROW = ("table9", "alpha=0.5")  # tools/compare_paper.py
CHANGES = {"reward.alpha": 0.5}


def get_config() -> ml_collections.ConfigDict:
  return derive(CHANGES)
