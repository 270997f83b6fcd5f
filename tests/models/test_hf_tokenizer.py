"""load_hf_tokenizer: the same tokenizer as AutoTokenizer's, without torch."""

import json
import os
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from cmimem_jax.encoders.neural import minilm_directory
from cmimem_jax.models.hf_tokenizer import load_hf_tokenizer
from cmimem_jax.models.qwen3.params import (gguf_tokenizer_cache,
                                            load_gguf_tokenizer,
                                            smollm2_gguf_path)
from cmimem_jax.testing import standins

MESSAGES = [{"role": "system", "content": "Keep the user's facts."},
            {"role": "user", "content": "I moved to Paris in 2021 🙂"},
            {"role": "assistant", "content": "ADD episodic: moved to Paris"}]


@pytest.fixture(scope="module")
def texts() -> list[str]:
  # The bundled LongMemEval sample's turns, plus what byte-level and
  # WordPiece tokenizers treat specially.
  return standins.corpus()[:200] + [
      "  leading spaces\tand tabs\n\nnewlines ", "ÜNÎCÖDÉ 東京 naïve café",
      "<|im_start|>user\nhi<|im_end|>", ""]


def _qwen_standin(directory: str) -> str:
  """A tokenizer with Qwen3's pipeline (NFC, Qwen's split regex, byte-level
  BPE) trained on the bundled sample, declared a Qwen2Tokenizer as a Qwen3
  checkpoint's tokenizer_config.json does: AutoTokenizer then builds
  the class's own pipeline around the file's vocabulary and merges."""
  from tokenizers import Regex, normalizers, pre_tokenizers
  from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX
  tokenizer = standins.make_tokenizer(directory, standins.corpus())
  backend = tokenizer.backend_tokenizer
  backend.normalizer = normalizers.NFC()
  backend.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tokenizer.save_pretrained(directory)
  path = os.path.join(directory, "tokenizer_config.json")
  with open(path) as f:
    config = json.load(f)
  config["tokenizer_class"] = "Qwen2Tokenizer"
  with open(path, "w") as f:
    json.dump(config, f)
  return directory


def _smollm2() -> str:
  load_gguf_tokenizer(smollm2_gguf_path())  # Converted into the cache once.
  return gguf_tokenizer_cache(smollm2_gguf_path())


@pytest.mark.parametrize("which", ["smollm2", "minilm", "qwen_standin"])
def test_same_ids_specials_and_chat_template_as_autotokenizer(
    which, texts, tmp_path):
  directory = {"smollm2": _smollm2, "minilm": minilm_directory,
               "qwen_standin": lambda: _qwen_standin(str(tmp_path))}[which]()
  ours = load_hf_tokenizer(directory, padding_side="left")
  reference = AutoTokenizer.from_pretrained(directory, padding_side="left")
  assert len(ours) == len(reference) > 0
  for text in texts:
    ids = ours(text)["input_ids"]
    assert ids == reference(text)["input_ids"], text
    assert ours.decode(ids) == reference.decode(ids)
  for name in ("eos_token_id", "pad_token_id", "bos_token_id",
               "all_special_ids", "padding_side", "model_max_length"):
    assert getattr(ours, name) == getattr(reference, name), name
  assert ours.padding_side == "left"
  batch = ours(texts[:3], padding=True)["input_ids"]
  assert batch == reference(texts[:3], padding=True)["input_ids"]
  if reference.chat_template:
    for prompt in (True, False):
      assert (ours.apply_chat_template(MESSAGES, tokenize=False,
                                       add_generation_prompt=prompt)
              == reference.apply_chat_template(MESSAGES, tokenize=False,
                                               add_generation_prompt=prompt))


def test_loading_the_policy_and_encoder_tokenizers_imports_no_torch():
  # AutoTokenizer's config machinery imports torch (3 s, ~0.2 GiB) in
  # processes that never run a torch model.
  code = ("import sys\n"
          "from cmimem_jax.sampling.policy import load_tokenizer\n"
          "from cmimem_jax.encoders.neural import minilm_directory\n"
          "from cmimem_jax.models.hf_tokenizer import load_hf_tokenizer\n"
          "assert len(load_tokenizer('')) == 49152\n"
          "load_hf_tokenizer(minilm_directory())\n"
          "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True,
                          text=True, check=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert result.stdout.strip().splitlines()[-1] == "[]"
