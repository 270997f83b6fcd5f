import json
import os

import numpy as np
import pytest

from cmimem_jax.models.qwen3.params import (permute_qk, smollm2_gguf_path,
                                            unpermute_qk)
from cmimem_jax.testing import run_tool


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
  from tools import compare_reference
  result = run_tool(compare_reference, ["--gguf", _smollm2_gguf()])
  assert result["kind"] == "causal_lm" and result["n_tokens"] > 50
  assert result["max_abs_diff"] < 1e-3
  assert result["argmax_agreement"] == 1.0


@pytest.mark.slow
def test_cached_gguf_tokenizer_equals_the_conversion(tmp_path, monkeypatch):
  """The GGUF's tokenizer: SmolLM2's chat template and a decode round
  trip; the on-disk copy tokenizes, templates and decodes like a fresh
  conversion; a damaged copy is converted again and replaced."""
  from cmimem_jax.models.qwen3.params import load_gguf_tokenizer
  monkeypatch.setenv("CMIMEM_CACHE_DIR", str(tmp_path))
  path = _smollm2_gguf()
  # The first load converts (the conversion is what it returns) and writes
  # the copy; the second reads the copy.
  fresh = load_gguf_tokenizer(path)
  text = fresh.apply_chat_template(
      [{"role": "user", "content": "Hi there"}], tokenize=False,
      add_generation_prompt=True)
  assert "<|im_start|>user\nHi there<|im_end|>" in text
  assert text.endswith("<|im_start|>assistant\n")
  ids = fresh("Hello world")["input_ids"]
  assert fresh.decode(ids).endswith("Hello world")
  (entry,) = os.listdir(tmp_path / "tokenizers")
  copy_dir = tmp_path / "tokenizers" / entry
  assert (copy_dir / "tokenizer.json").exists()
  cached = load_gguf_tokenizer(path)
  messages = [{"role": "system", "content": "Keep notes."},
              {"role": "user", "content": "Olá ñandú 🙂  tabs\tand <|im_end|>"}]
  text = "Grüße, 東京!\n\n  spaced  out <|im_start|>"
  assert type(cached) is type(fresh)
  assert cached.apply_chat_template(
      messages, add_generation_prompt=True) == fresh.apply_chat_template(
          messages, add_generation_prompt=True)
  ids = cached.encode(text, add_special_tokens=False)
  assert ids == fresh.encode(text, add_special_tokens=False)
  assert cached.decode(ids) == fresh.decode(ids)
  assert len(cached) == len(fresh)
  assert cached.all_special_tokens == fresh.all_special_tokens
  assert (cached.eos_token_id, cached.pad_token_id) == (
      fresh.eos_token_id, fresh.pad_token_id)
  (copy_dir / "tokenizer.json").write_text("{not json")
  repaired = load_gguf_tokenizer(path)
  assert repaired.encode(text) == fresh.encode(text)
  assert os.listdir(tmp_path / "tokenizers") == [entry]
  json.loads((copy_dir / "tokenizer.json").read_text())  # Replaced.
  assert load_gguf_tokenizer(path).encode(text) == fresh.encode(text)
