import dataclasses
import importlib
import pathlib
import re
from typing import ClassVar

import ml_collections
import numpy as np
import pytest

from cmimem_jax.config import (ConfigError, Section, apply_overrides,
                               validate_config)
from cmimem_jax.data import bundled_path
from cmimem_jax.encoders import instructed_query, make_encoder
from cmimem_jax.evaluation.paper import paper_rows
from cmimem_jax.evaluation.run import EVALUATION_SECTIONS
from cmimem_jax.data import DatasetConfig
from cmimem_jax.encoders import EncoderConfig
from cmimem_jax.memory.builder import MemoryConfig
from cmimem_jax.parallel import MeshConfig
from cmimem_jax.task.loop import (TRAINING_SECTIONS, RLConfig,
                                  RolloutConfig)
from cmimem_jax.task.reward import RewardConfig
from configs import (build_memory, eval_qwen3_4b, qwen3_4b, qwen3_4b_h20_vllm,
                     qwen3_4b_tpu)
from tools import build_expert_states


def test_shipped_config_is_valid(locomo_path):
  config = build_memory.get_config()
  config.dataset.path = locomo_path
  validate_config(config, required=(DatasetConfig, EncoderConfig,
                                    MemoryConfig))


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

  @dataclasses.dataclass(frozen=True)
  class PolicyModel(Section):
    SECTION: ClassVar[str] = "policy_model"

  with pytest.raises(ConfigError) as info:
    validate_config(config, required=(DatasetConfig, EncoderConfig,
                                      MemoryConfig, RewardConfig,
                                      PolicyModel))
  message = str(info.value)
  for expected in ["dataset.name='squad'", "dataset.path='/nonexistent.json'",
                   "encoder.dim=0", "memory.compress_trigger=1.5",
                   "memory.qa_top_k: missing",
                   "compress_target_chars must not exceed",
                   "policy_model: missing section",
                   "reward.shaping='cubic': must be 'gaussian' or 'none'"]:
    assert expected in message


def test_minilm_takes_only_its_own_width(locomo_path):
  config = build_memory.get_config()
  config.dataset.path = locomo_path
  config.encoder.dim = 1024
  with pytest.raises(ConfigError, match=r"encoder.dim=1024: must be 384"):
    validate_config(config, required=(EncoderConfig,))


def test_only_the_named_sections_are_checked():
  config = build_memory.get_config()
  config.dataset.path = bundled_path()
  config.reward.shaping = "cubic"
  validate_config(config, required=(DatasetConfig, EncoderConfig,
                                    MemoryConfig))
  with pytest.raises(ConfigError, match="shaping='cubic': must be"):
    validate_config(config, required=(DatasetConfig, RewardConfig))


class _Validated(Exception):
  """Raised where build_expert_states starts work: its config passed."""


def test_build_expert_states_checks_only_what_it_reads(tmp_path, monkeypatch):
  """Its documented command (`configs/qwen3_4b.py`, `rl.snapshots` left
  at '': the directory this tool writes) passes validation; a bad field
  of a section it reads still fails."""
  def started(section):
    raise _Validated

  monkeypatch.setattr(build_expert_states, "make_encoder", started)

  def build(**overrides):
    config = qwen3_4b.get_config()
    config.dataset.path = bundled_path()
    config.encoder.path = str(tmp_path)
    assert config.rl.snapshots == ""
    build_expert_states.build(apply_overrides(config, overrides),
                              str(tmp_path / "states"), None, "teacher",
                              "agents")

  with pytest.raises(_Validated):
    build()
  for overrides, problem in (({"dataset.path": "/nonexistent.json"},
                              "dataset.path='/nonexistent.json'"),
                             ({"encoder.path": "/nonexistent"},
                              "encoder.path='/nonexistent'"),
                             ({"memory.qa_top_k": 0}, "memory.qa_top_k=0")):
    with pytest.raises(ConfigError, match=re.escape(problem)):
      build(**overrides)


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
  config.rl.snapshots = str(tmp_path)  # The expert states' directory.
  return config


def test_the_4b_hardware_configs_differ_only_in_hardware(tmp_path):
  base = qwen3_4b.get_config()
  for module in (qwen3_4b_tpu, qwen3_4b_h20_vllm):
    config = module.get_config()
    changed = _differing(base, config)
    assert changed and all(
        any(key == field or key.startswith(field + ".")
            for field in qwen3_4b.HARDWARE_FIELDS) for key in changed), changed
    # One CMI reward: App. F's conditioning set on both; fixed expert
    # states M_{t-1}, never refreshed.
    assert config.reward == base.reward
    assert config.rl.snapshots != "policy"
    assert (config.reward.conditioning.top_k,
            config.reward.conditioning.n_recent) == (8, 2)
    validate_config(_filled(config, tmp_path), required=TRAINING_SECTIONS)


def _tiny_qwen3_embedding(directory):
  """A random Qwen3-Embedding checkpoint (any tokenizer will do)."""
  import torch
  import transformers
  from cmimem_jax.encoders.neural import minilm_directory
  try:
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_directory())
  except FileNotFoundError as e:
    pytest.skip(str(e))
  torch.manual_seed(0)
  transformers.Qwen3Model(transformers.Qwen3Config(
      vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=48,
      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
      head_dim=16, max_position_embeddings=128)).save_pretrained(directory)
  tokenizer.save_pretrained(directory)
  return str(directory)


def test_the_4b_hardware_configs_embed_the_same_query_text(tmp_path):
  """What the encoder receives for a query: the TPU config's in-process
  Qwen3-Embedding and the H20 config's vLLM endpoint get the same text."""
  received = {}
  for module in (qwen3_4b_tpu, qwen3_4b_h20_vllm):
    section = module.get_config().encoder
    if section.kind == "qwen3_embedding":
      section.path = _tiny_qwen3_embedding(tmp_path / "emb")
    encoder = make_encoder(EncoderConfig.from_config(section))
    texts = []
    if section.kind == "openai":
      encoder.client.embed = lambda batch: (  # noqa: E731
          texts.extend(batch), np.ones((len(batch), section.dim)))[1]
    else:
      windows = encoder.windows
      encoder.windows = lambda batch: (texts.extend(batch),  # noqa: E731
                                       windows(batch))[1]
    encoder.encode(["When did Maya adopt Biscuit?"], kind="query")
    received[module.__name__] = texts
  first, second = received.values()
  assert first == second == [instructed_query(
      qwen3_4b.get_config().encoder.query_instruction,
      "When did Maya adopt Biscuit?")]
  assert first[0].startswith("Instruct: ") and first[0].endswith(
      "\nQuery:When did Maya adopt Biscuit?")


def test_symmetric_encoders_refuse_an_instruction():
  config = build_memory.get_config()
  config.dataset.path = bundled_path()
  config.encoder.query_instruction = "Find it"
  with pytest.raises(ConfigError, match="takes no instruction"):
    validate_config(config, required=(EncoderConfig,))


ABLATIONS = sorted(p.stem for p in (
    pathlib.Path(__file__).parent.parent / "configs" / "ablations").glob(
        "table*.py"))


def _filled_evaluation(config, tmp_path):
  config.dataset.path = bundled_path()
  config.encoder.path = config.builder.path = str(tmp_path)
  return config


@pytest.mark.parametrize("name", ABLATIONS)
def test_ablation_configs_differ_from_the_base_in_their_changes(
    name, tmp_path):
  module = importlib.import_module(f"configs.ablations.{name}")
  config = module.get_config()
  assert _differing(module.BASE.get_config(), config) == set(module.CHANGES)
  for key, value in module.CHANGES.items():
    assert _flat(config)[key] == value
  table, row = module.PAPER_ROW
  assert row in {r["variant"] for r in paper_rows(table)}
  if module.BASE is eval_qwen3_4b:
    validate_config(_filled_evaluation(config, tmp_path),
                    required=EVALUATION_SECTIONS)
  else:
    assert module.BASE is qwen3_4b_tpu
    validate_config(_filled(config, tmp_path), required=TRAINING_SECTIONS)


def test_the_prompting_rows_of_table_3_are_evaluations_of_the_agents():
  """"Qwen3-4B" and "+RM" equal Table 1's MemBuilder-P / Ours-P: the base
  model through the four JSON agents (no GRPO), flat vs retrieval-indexed
  memory."""
  from configs.ablations import table3_qwen3_4b, table3_rm
  for module, source_chunks in ((table3_qwen3_4b, False), (table3_rm, True)):
    config = module.get_config()
    assert config.method == "prompting"
    assert config.builder.init_checkpoint == ""  # The base model.
    assert config.memory.source_chunks is source_chunks


def test_the_4b_evaluation_config_is_the_papers_protocol(tmp_path):
  config = eval_qwen3_4b.get_config()
  assert config.builder.max_new_tokens >= 6000
  assert config.builder.endpoint.max_tokens >= 6000
  assert not config.builder.constrained_dsl and config.method == "policy"
  assert config.encoder == qwen3_4b.get_config().encoder
  assert config.encoder.kind == "qwen3_embedding"
  assert (config.memory.qa_top_k, config.memory.source_chunks) == (10, True)
  assert config.judge.kind == "llm" and config.judge.prompt == "listing11"
  assert config.answer.kind == "endpoint"
  assert (config.dataset.name, config.dataset.split) == ("longmemeval",
                                                         "test")
  validate_config(_filled_evaluation(config, tmp_path),
                  required=EVALUATION_SECTIONS)


def test_every_ablation_row_of_tables_3_and_9_has_a_config():
  covered = {importlib.import_module(f"configs.ablations.{n}").PAPER_ROW
             for n in ABLATIONS}
  # Table 9's "CMI-Mem (full)" is Table 3's (the same run).
  wanted = {(t, r["variant"]) for t in ("table3", "table9")
            for r in paper_rows(t)} - {("table9", "CMI-Mem (full)")}
  assert wanted == covered


def test_mesh_decoding_waves_must_split_evenly_over_the_batch_shards():
  """`rollout.decode_devices`: "one" or "mesh"; with "mesh" every wave is
  whole groups on every batch shard (the 8 fake devices here), so no wave
  of a training step is padded."""
  config = qwen3_4b_tpu.get_config()
  config.mesh = "fsdp:8"
  config.rl.snapshots = "policy"
  sections = (RolloutConfig, RLConfig, MeshConfig)
  validate_config(config, required=sections)  # 128 rows = 2 groups x 8.
  config.rollout.max_rows_per_wave = 96
  with pytest.raises(ConfigError, match=re.escape(
      "rollout.max_rows_per_wave=96 must be whole groups of 8 rollouts x 8 "
      "batch shards")):
    validate_config(config, required=sections)
  config.rollout.decode_devices = "one"  # One device: any whole groups.
  validate_config(config, required=sections)
  config.rollout.decode_devices = "all"
  with pytest.raises(ConfigError, match="rollout.decode_devices='all'"):
    validate_config(config, required=sections)
