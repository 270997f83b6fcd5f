import numpy as np
import pytest
import torch

from cmimem_jax.models.qwen3 import (Qwen3Config, load_hf, positions_from_mask,
                                     save_hf)
from cmimem_jax.testing.hf_models import hf_causal_lm, left_padded_batch


def _hf_logits(model, tokens, mask):
  positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
  with torch.no_grad():
    out = model(input_ids=torch.from_numpy(tokens).long(),
                attention_mask=torch.from_numpy(mask).long(),
                position_ids=torch.from_numpy(positions).long())
  return out.logits.numpy()


@pytest.mark.parametrize("model_type,overrides", [
    ("qwen3", dict(num_key_value_heads=1)),
    ("qwen3", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    ("qwen3", dict(num_key_value_heads=4, head_dim=20, rope_theta=5e6)),
    ("llama", dict(num_key_value_heads=2, head_dim=12, tie_word_embeddings=True)),
])
def test_logits_match_transformers(tmp_path, model_type, overrides):
  hf, directory = hf_causal_lm(tmp_path, model_type, **overrides)
  ours = load_hf(directory)
  assert ours.config.qk_norm == (model_type == "qwen3")
  assert (ours.lm_head is None) == ours.config.tie_word_embeddings
  tokens, mask = left_padded_batch(97, [11, 7, 3], 12)
  want = _hf_logits(hf, tokens, mask)
  got, _ = ours(tokens, positions_from_mask(mask), mask)
  real = mask.astype(bool)
  np.testing.assert_allclose(np.asarray(got)[real], want[real], atol=1e-4,
                             rtol=0)


def test_round_trip_through_transformers(tmp_path):
  import transformers
  hf, directory = hf_causal_lm(tmp_path, "qwen3")
  ours = load_hf(directory)
  out = tmp_path / "ours"
  save_hf(ours, str(out), max_shard_bytes=20_000)  # Forces sharded files.
  assert (out / "model.safetensors.index.json").exists()
  back = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
  tokens, mask = left_padded_batch(97, [9, 5], 10, seed=1)
  np.testing.assert_allclose(_hf_logits(back, tokens, mask),
                             _hf_logits(hf, tokens, mask), atol=1e-5)
  # And our loader reads the sharded files back.
  again = load_hf(str(out))
  a, _ = ours(tokens, positions_from_mask(mask), mask)
  b, _ = again(tokens, positions_from_mask(mask), mask)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_config_from_hf_and_errors(tmp_path):
  _, directory = hf_causal_lm(tmp_path, "qwen3", head_dim=20)
  config = Qwen3Config.from_pretrained(directory)
  assert (config.head_dim, config.rope_theta, config.qk_norm) == (20, 12345.0,
                                                                   True)
  with pytest.raises(ValueError, match="multiple"):
    Qwen3Config(**{**config.__dict__, "num_key_value_heads": 3})
  with pytest.raises(FileNotFoundError, match="config.json"):
    load_hf(str(tmp_path))
  (tmp_path / "config.json").write_text("{}")
  with pytest.raises(FileNotFoundError, match="model.safetensors"):
    load_hf(str(tmp_path), config=config)
