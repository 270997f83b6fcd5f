"""Table 9 "w. emb": unconditional embedding cosine as the CMI estimate
(our reading: the full method is already embedding-based)."""

import ml_collections

from configs import qwen3_4b_tpu
from configs.ablations import derive

PAPER_ROW = ("table9", "w. emb")  # tools/compare_paper.py
BASE = qwen3_4b_tpu
CHANGES = {"reward.estimator": "cosine"}


def get_config() -> ml_collections.ConfigDict:
  return derive(CHANGES, BASE)
