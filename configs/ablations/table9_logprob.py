"""Table 9 "w. logprob": the App. E estimator (Listing 8 profiles written
and scored under M_{t-1} and M_t by the frozen reference p_ref, the KL
reference's initial weights, never the live policy: docs/departures.md,
"App. E p_ref")."""

import ml_collections

from configs import qwen3_4b_tpu
from configs.ablations import derive

PAPER_ROW = ("table9", "w. logprob")  # tools/compare_paper.py
BASE = qwen3_4b_tpu
CHANGES = {"reward.estimator": "logprob"}


def get_config() -> ml_collections.ConfigDict:
  return derive(CHANGES, BASE)
