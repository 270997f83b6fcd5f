import os

import numpy as np
import pytest

from cmimem_jax.models.qwen3.params import (permute_qk, smollm2_gguf_path,
                                            unpermute_qk)


def _smollm2_gguf() -> str:
  try:
    return smollm2_gguf_path()
  except FileNotFoundError as e:
    pytest.skip(str(e))


def test_qk_permutation_round_trip():
  w = np.arange(8 * 4 * 3, dtype=np.float32).reshape(8 * 4, 3)
  np.testing.assert_array_equal(unpermute_qk(permute_qk(w, 4), 4), w)
  assert not np.array_equal(permute_qk(w, 4), w)


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers_gguf_loader():
  import sys
  sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..",
                                  "tools"))
  import compare_reference
  result = compare_reference.main(["--gguf", _smollm2_gguf()])
  assert result["kind"] == "causal_lm" and result["n_tokens"] > 50
  assert result["max_abs_diff"] < 1e-3
  assert result["argmax_agreement"] == 1.0


@pytest.mark.slow
def test_gguf_tokenizer_and_chat_template():
  from cmimem_jax.models.qwen3 import load_gguf_tokenizer
  tokenizer = load_gguf_tokenizer(_smollm2_gguf())
  text = tokenizer.apply_chat_template(
      [{"role": "user", "content": "Hi there"}], tokenize=False,
      add_generation_prompt=True)
  assert "<|im_start|>user\nHi there<|im_end|>" in text
  assert text.endswith("<|im_start|>assistant\n")
  ids = tokenizer("Hello world")["input_ids"]
  assert tokenizer.decode(ids).endswith("Hello world")
