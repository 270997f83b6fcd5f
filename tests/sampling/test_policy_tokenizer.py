"""The policy's tokenizer comes from its checkpoint, never silently from the
embedded SmolLM2, and must fit the model's embedding table (issue: a
Qwen3-4B run trained on SmolLM2 token ids)."""

import os
import shutil
import subprocess
import sys
import time

import pytest

from cmimem_jax.evaluation.run import BuilderModelConfig, make_chat_model
from cmimem_jax.models.qwen3.params import smollm2_gguf_path
from cmimem_jax.sampling import (PolicyConfig, load_policy_and_tokenizer,
                                 policy_tokenizer_path)
from cmimem_jax.testing import standins
from configs import eval_cpu

REPO = os.path.join(os.path.dirname(__file__), "..", "..")
VOCAB = 320  # The stand-in's own vocabulary: not SmolLM2's 49,152.


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """An HF policy checkpoint with its own tokenizer, and a copy without."""
  root = tmp_path_factory.mktemp("standin")
  tokenizer = standins.make_tokenizer(str(root / "tokenizer"),
                                      standins.corpus(), VOCAB)
  policy = standins.make_policy_checkpoint(str(root / "policy"), tokenizer)
  bare = root / "bare"
  bare.mkdir()
  for name in ("config.json", "model.safetensors"):
    shutil.copy(os.path.join(policy, name), bare / name)
  return {"policy": policy, "bare": str(bare)}


def _section(path: str, tokenizer: str = "") -> PolicyConfig:
  return PolicyConfig(
      source="hf", preset="tiny", path=path, seed=0, tokenizer=tokenizer,
      dtype="float32", param_dtype="float32", remat="none",
      attention_impl="batched", max_position_embeddings=2048)


def test_an_hf_policy_reads_its_checkpoints_tokenizer(checkpoints):
  model, tokenizer = load_policy_and_tokenizer(_section(checkpoints["policy"]))
  assert len(tokenizer) == VOCAB
  assert model.config.vocab_size >= VOCAB
  assert tokenizer.eos_token_id == model.config.eos_token_id


def test_evaluation_reads_the_same_tokenizer_as_training(checkpoints):
  builder = eval_cpu.get_config().builder
  builder.update({"kind": "local", "path": checkpoints["policy"],
                  "max_new_tokens": 8})
  _, training = load_policy_and_tokenizer(_section(checkpoints["policy"]))
  evaluation = make_chat_model(
      BuilderModelConfig.from_config(builder)).tokenizer
  messages = [{"role": "user", "content": "I moved to Lisbon in May."}]
  assert (evaluation.apply_chat_template(messages, tokenize=False)
          == training.apply_chat_template(messages, tokenize=False))
  assert evaluation.get_vocab() == training.get_vocab()


def test_a_checkpoint_without_tokenizer_files_is_refused(checkpoints):
  with pytest.raises(ValueError, match="holds no tokenizer"):
    policy_tokenizer_path(_section(checkpoints["bare"]))
  # Naming one is the way out.
  named = _section(checkpoints["bare"], tokenizer=checkpoints["policy"])
  assert policy_tokenizer_path(named) == checkpoints["policy"]


def test_a_tokenizer_larger_than_the_embedding_table_is_refused(checkpoints):
  section = _section(checkpoints["policy"], tokenizer=smollm2_gguf_path())
  with pytest.raises(ValueError, match=r"49152 tokens .* 320 rows"):
    load_policy_and_tokenizer(section)


@pytest.mark.slow
def test_train_refuses_a_checkpoint_without_a_tokenizer_in_one_line(
    checkpoints, tmp_path):
  started = time.monotonic()
  result = subprocess.run(
      [sys.executable, "-m", "cmimem_jax.train", "--config=configs/tiny.py",
       f"--workdir={tmp_path / 'run'}", "--config.mesh=fsdp:2,tensor:4",
       "--config.policy.source=hf",
       f"--config.policy.path={checkpoints['bare']}"],
      cwd=REPO, capture_output=True, text=True, timeout=120)
  assert time.monotonic() - started < 60
  assert result.returncode == 1, result.stderr
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and "holds no tokenizer" in lines[0], lines
