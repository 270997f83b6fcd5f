import importlib
import pathlib

import ml_collections
import pytest

import cmimem_jax.task.loop  # noqa: F401 - registers every training section.
from cmimem_jax.config import ConfigError, validate_config
from cmimem_jax.data import bundled_path
from cmimem_jax.evaluation.paper import paper_rows
from configs import build_memory, qwen3_4b, qwen3_4b_h20_vllm, qwen3_4b_tpu


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


def _flat(config) -> dict:
  """`{"a.b": value}` for every leaf of a ConfigDict."""
  out = {}
  for key, value in config.items():
    if isinstance(value, ml_collections.ConfigDict):
      out.update({f"{key}.{k}": v for k, v in _flat(value).items()})
    else:
      out[key] = value
  return out


def _differing(a, b) -> set[str]:
  fa, fb = _flat(a), _flat(b)
  return {k for k in fa.keys() | fb.keys() if fa.get(k) != fb.get(k)}


def _filled(config, tmp_path):
  """Paths a real run passes on the command line."""
  config.dataset.path = bundled_path()
  config.encoder.path = config.policy.path = str(tmp_path)
  return config


def test_the_4b_hardware_configs_differ_only_in_hardware(tmp_path):
  base = qwen3_4b.get_config()
  for module in (qwen3_4b_tpu, qwen3_4b_h20_vllm):
    config = module.get_config()
    changed = _differing(base, config)
    assert changed and all(
        any(key == field or key.startswith(field + ".")
            for field in qwen3_4b.HARDWARE_FIELDS) for key in changed), changed
    # One CMI reward: App. F's conditioning set on both.
    assert config.reward == base.reward
    assert (config.reward.conditioning.top_k,
            config.reward.conditioning.n_recent) == (8, 2)
    validate_config(_filled(config, tmp_path),
                    required=("dataset", "memory", "reward", "policy",
                              "rollout", "rl", "qa"))


ABLATIONS = sorted(p.stem for p in (
    pathlib.Path(__file__).parent.parent / "configs" / "ablations").glob(
        "table*.py"))


@pytest.mark.parametrize("name", ABLATIONS)
def test_ablation_configs_differ_from_the_base_in_their_changes(
    name, tmp_path):
  module = importlib.import_module(f"configs.ablations.{name}")
  config = module.get_config()
  assert _differing(qwen3_4b_tpu.get_config(), config) == set(module.CHANGES)
  for key, value in module.CHANGES.items():
    assert _flat(config)[key] == value
  table, row = module.PAPER_ROW
  assert row in {r["variant"] for r in paper_rows(table)}
  validate_config(_filled(config, tmp_path),
                  required=("dataset", "memory", "reward", "policy",
                            "rollout", "rl", "qa"))


def test_every_ablation_row_of_tables_3_and_9_has_a_config():
  covered = {importlib.import_module(f"configs.ablations.{n}").PAPER_ROW
             for n in ABLATIONS}
  # Table 9's "CMI-Mem (full)" is Table 3's (the same run).
  wanted = {(t, r["variant"]) for t in ("table3", "table9")
            for r in paper_rows(t)} - {("table9", "CMI-Mem (full)")}
  assert wanted == covered
