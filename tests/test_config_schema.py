"""The typed config schema: one frozen dataclass per section, built and
checked by `validate_config`, which collects every problem of every
section into one `ConfigError` (one line each, naming `section.key`)."""

import importlib
import json
import pathlib

import ml_collections
import pytest

from cmimem_jax.config import ConfigError, validate_config
from cmimem_jax.data import DatasetConfig, bundled_path
from cmimem_jax.encoders import ENCODERS, EncoderConfig
from cmimem_jax.evaluation.run import (EVALUATION_SECTIONS,
                                       AnswerModelConfig, BuilderModelConfig,
                                       EvaluationConfig, JudgeConfig)
from cmimem_jax.memory.builder import MemoryConfig
from cmimem_jax.parallel import MeshConfig
from cmimem_jax.rl import CheckpointConfig
from cmimem_jax.sampling import PolicyConfig
from cmimem_jax.serving import SERVE_SECTIONS, ServeConfig, ServeRunConfig
from cmimem_jax.task.build_memory import (BUILD_MEMORY_SECTIONS,
                                          BuildMemoryConfig)
from cmimem_jax.task.loop import (TRAINING_SECTIONS, LoopState, RLConfig,
                                  RolloutConfig, RunConfig)
from cmimem_jax.task.qa_reward import QAConfig
from cmimem_jax.task.reward import RewardConfig
from cmimem_jax.task.warm_start import SFT_SECTIONS, SFTConfig
from configs import build_memory, default, eval_cpu, serve_cpu

# (section type, dotted field, a bad value) for every section: one field
# each, the value of the right type but out of range or not a choice.
BAD_FIELDS = [
    (RunConfig, "seed", "zero"),
    (MeshConfig, "mesh", "rows:2"),
    (DatasetConfig, "dataset.name", "squad"),
    (EncoderConfig, "encoder.kind", "word2vec"),
    (MemoryConfig, "memory.qa_top_k", 0),
    (RewardConfig, "reward.alpha", 1.5),
    (PolicyConfig, "policy.source", "onnx"),
    (RolloutConfig, "rollout.top_p", 1.5),
    (RLConfig, "rl.epsilon_low", 1.0),
    (QAConfig, "qa.judge", "human"),
    (CheckpointConfig, "checkpoint.keep", 0),
    (SFTConfig, "sft.batch_size", 0),
    (EvaluationConfig, "method", "oracle"),
    (JudgeConfig, "judge.prompt", "listing12"),
    (AnswerModelConfig, "answer.kind", "human"),
    (BuilderModelConfig, "builder.kind", "none"),
    (ServeConfig, "serve.max_batch", 0),
    (ServeRunConfig, "seed", "zero"),
    (BuildMemoryConfig, "policy", "oracle"),
]
# Every entry point's sections.
ALL_SECTIONS = (set(TRAINING_SECTIONS) | set(SFT_SECTIONS)
                | set(EVALUATION_SECTIONS) | set(SERVE_SECTIONS)
                | set(BUILD_MEMORY_SECTIONS))


def _training() -> ml_collections.ConfigDict:
  config = default.get_config()
  config.sft.data = bundled_path()  # Any existing file will do.
  return config


def _config_for(kind: type) -> ml_collections.ConfigDict:
  if kind in (ServeConfig, ServeRunConfig):
    return serve_cpu.get_config()
  if kind is BuildMemoryConfig:
    config = build_memory.get_config()
    config.dataset.path = bundled_path()
    config.dataset.name = "longmemeval"
    return config
  return (eval_cpu.get_config() if kind in EVALUATION_SECTIONS
          and kind not in TRAINING_SECTIONS else _training())


def _set(config: ml_collections.ConfigDict, dotted: str, value) -> None:
  """Sets a field to a value of any type (ConfigDict refuses a new type
  on assignment; a config file or override can still hold one)."""
  *parents, leaf = dotted.split(".")
  node = config
  for part in parents:
    node = node[part]
  with node.ignore_type():
    node[leaf] = value


def _problems(config, required) -> list[str]:
  with pytest.raises(ConfigError) as error:
    validate_config(config, required=required)
  first, *lines = str(error.value).splitlines()
  assert first == "invalid config:"
  return [line.strip() for line in lines]


@pytest.mark.parametrize("kind,field,value", BAD_FIELDS,
                         ids=[f for _, f, _ in BAD_FIELDS])
def test_one_bad_field_is_one_problem_naming_it(kind, field, value):
  config = _config_for(kind)
  validate_config(config, required=(kind,))  # Valid as shipped.
  _set(config, field, value)
  (problem,) = _problems(config, (kind,))
  assert problem.startswith(f"{field}={value!r}: "), problem


def test_every_section_has_a_bad_field_case():
  assert {k for k, _, _ in BAD_FIELDS} == ALL_SECTIONS


def test_bad_fields_of_several_sections_are_reported_together():
  config = _training()
  cases = [c for c in BAD_FIELDS if c[0] in TRAINING_SECTIONS]
  for _, field, value in cases:
    _set(config, field, value)
  problems = _problems(config, TRAINING_SECTIONS)
  assert len(problems) == len(cases)
  for (_, field, value), problem in zip(
      sorted(cases, key=lambda c: c[1]), sorted(problems)):
    assert problem.startswith(f"{field}={value!r}"), problem


def test_unknown_missing_and_mistyped_keys_are_named():
  config = _training()
  config.rl.steps = 3
  del config.rollout["engine"]
  _set(config, "memory.build_top_k", "twenty")
  assert sorted(_problems(config, (RLConfig, RolloutConfig, MemoryConfig))
                ) == ["memory.build_top_k='twenty': must be an integer",
                      "rl.steps: unknown setting (nearest known: "
                      "rl.max_steps)",
                      "rollout.engine: missing"]


def test_the_epsilon_high_rule_is_the_objectives():
  """`rl.epsilon_high` above 1 (a ratio ceiling over 2) is the GRPO
  objective's to accept, and it does; below 0 neither accepts."""
  config = _training()
  config.rl.epsilon_high = 1.5
  assert validate_config(config, (RLConfig,))[RLConfig].loss_config(
      ).epsilon_high == 1.5
  config.rl.epsilon_high = -0.1
  assert _problems(config, (RLConfig,)) == [
      "rl.epsilon_high=-0.1: must be >= 0"]


def test_a_cross_section_rule_names_both_sections():
  config = _training()
  config.memory.compressor = "answer"  # The answer model: qa.judge="llm".
  assert _problems(config, (MemoryConfig, QAConfig)) == [
      "memory.compressor='answer' needs qa.judge='llm' (the answer model "
      "is its endpoint)"]
  validate_config(config, (MemoryConfig,))  # Only asked with qa.


CONFIGS = sorted(p.stem for p in (
    pathlib.Path(__file__).parent.parent / "configs").glob("*.py")
    if p.stem not in ("__init__", "paper"))


@pytest.mark.parametrize("name", CONFIGS)
def test_every_config_file_validates_for_its_entry_points(name, tmp_path):
  """Each config file passes the sections its entry points read, with
  only the paths a run passes on its command line filled in."""
  config = importlib.import_module(f"configs.{name}").get_config()
  if "dataset" in config and not config.dataset.path:
    config.dataset.path = bundled_path()
  if "dataset" in config and not pathlib.Path(config.dataset.path).exists():
    config.dataset.path = bundled_path()
    config.dataset.name, config.dataset.split = "longmemeval", ""
  for section in ("encoder", "policy", "builder"):
    if isinstance(config.get(section), ml_collections.ConfigDict) and (
        config[section].get("kind", "") != "minilm"
        and "path" in config[section]):
      config[section].path = config[section].path or str(tmp_path)
  if "rl" in config and config.rl.snapshots == "":
    config.rl.snapshots = str(tmp_path)  # The expert states' directory.
  if "sft" in config:
    config.sft.data = bundled_path()
  if "mesh" in config and config.mesh == "fsdp:8":
    config.mesh = "fsdp:-1"  # The H20 machine's 8 GPUs; 8 CPUs here.
  required = [kind for kind in ALL_SECTIONS
              if isinstance(config.get(kind.SECTION),
                            ml_collections.ConfigDict) or (
                  not kind.SECTION and all(
                      f in config for f in kind.__dataclass_fields__))]
  assert required
  sections = validate_config(config, required=required)
  # Each section as the config holds it, as JSON (what settings files
  # record: lists for tuples).
  for kind in required:
    if kind.SECTION:
      assert json.loads(json.dumps(sections[kind].as_config_dict())) == (
          json.loads(json.dumps(config[kind.SECTION].to_dict())))


def test_the_loop_state_is_the_checkpoints_json():
  """Checkpoints keep the loop state as the JSON object they always held
  (`{"step", "snapshot_version", "snapshot_epoch"}`): an older one
  restores, an unknown key is refused."""
  import dataclasses
  saved = {"step": 4, "snapshot_version": 1, "snapshot_epoch": 2}
  state = LoopState.from_saved(saved)
  assert (state.step, state.snapshot_version, state.snapshot_epoch) == (
      4, 1, 2)
  assert dataclasses.asdict(state) == saved
  assert LoopState.from_saved({"step": 2}) == LoopState(step=2)
  with pytest.raises(ValueError, match="unknown keys"):
    LoopState.from_saved({**saved, "data_position": 3})


def test_build_memory_refuses_a_model_editor_with_the_other_problems():
  """`build_memory` runs no chat model: a memory editor that needs one is
  a problem of its own, collected with a bad field elsewhere."""
  config = _config_for(BuildMemoryConfig)
  config.memory.compressor = "policy"
  config.encoder.kind = "word2vec"
  problems = _problems(config, BUILD_MEMORY_SECTIONS)
  assert sorted(problems) == [
      "encoder.kind='word2vec': must be one of "
      f"{ENCODERS}",
      "memory.compressor='policy': build_memory runs no chat model; use "
      "'none'"]
