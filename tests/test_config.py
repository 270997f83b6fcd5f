import pytest

import cmimem_jax.cmi  # noqa: F401 - registers the `reward` section.
from cmimem_jax.config import ConfigError, validate_config
from configs import build_memory


def test_shipped_config_is_valid(locomo_path):
  config = build_memory.get_config()
  config.dataset.path = locomo_path
  validate_config(config, required=("dataset", "encoder", "memory"))


def test_every_problem_is_reported_at_once():
  config = build_memory.get_config()
  config.dataset.name = "squad"
  config.dataset.path = "/nonexistent.json"
  config.encoder.kind = "hashing"
  config.encoder.dim = 0
  config.memory.compress_trigger = 1.5
  config.memory.compress_target_chars = 9000
  del config.memory["qa_top_k"]
  config.reward.shaping = "cubic"
  with pytest.raises(ConfigError) as info:
    validate_config(config, required=("dataset", "policy_model"))
  message = str(info.value)
  for expected in ["dataset.name='squad'", "dataset.path='/nonexistent.json'",
                   "encoder.dim=0", "memory.compress_trigger=1.5",
                   "memory.qa_top_k: missing",
                   "compress_target_chars must not exceed",
                   "policy_model: missing section",
                   "reward: shaping must be 'gaussian' or 'none'"]:
    assert expected in message
