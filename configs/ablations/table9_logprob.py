"""Table 9 "w. logprob": the App. E estimator (Listing 8 profiles scored by
the policy itself under M_{t-1} and M_t)."""

import ml_collections

from configs import qwen3_4b_tpu
from configs.ablations import derive

PAPER_ROW = ("table9", "w. logprob")  # tools/compare_paper.py
BASE = qwen3_4b_tpu
CHANGES = {"reward.estimator": "logprob"}


def get_config() -> ml_collections.ConfigDict:
  return derive(CHANGES, BASE)
