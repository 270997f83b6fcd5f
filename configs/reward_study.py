"""The reward validity study (`tools/reward_study.py`): one LoCoMo
conversation with all-MiniLM-L6-v2, the annotation builder's banks, the
paper's reward constants (under 10 minutes on 2 CPU cores).

  python -m tools.reward_study --config=configs/reward_study.py --output=DIR
"""

import ml_collections

from cmimem_jax.task.reward import reward_defaults
from cmimem_jax.config import memory_defaults


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.dataset = ml_collections.ConfigDict({
      "name": "locomo", "path": "../shared/data/locomo/locomo10.json"})
  config.encoder = ml_collections.ConfigDict(
      {"kind": "minilm", "dim": 384, "path": ""})
  config.memory = memory_defaults()
  config.reward = reward_defaults()
  config.study = ml_collections.ConfigDict({
      # START:STOP over the file's conversations.
      "conversations": "0:1",
      # Duplicates, paraphrases, irrelevant and future facts per session
      # (every own fact is scored).
      "per_class": 5, "seed": 0})
  return config
