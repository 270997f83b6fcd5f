"""Helpers that build random `transformers` models saved with save_pretrained."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def hf_causal_lm(tmp_path, model_type="qwen3", **overrides):
  """A random tiny HF causal LM saved to tmp_path; returns (model, dir)."""
  base = dict(vocab_size=97, hidden_size=48, intermediate_size=80,
              num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, rope_theta=12345.0,
              rms_norm_eps=1e-6, tie_word_embeddings=False,
              max_position_embeddings=256)
  base.update(overrides)
  config_cls = {"qwen3": transformers.Qwen3Config,
                "llama": transformers.LlamaConfig}[model_type]
  config = config_cls(**base)
  torch.manual_seed(0)
  model_cls = {"qwen3": transformers.Qwen3ForCausalLM,
               "llama": transformers.LlamaForCausalLM}[model_type]
  model = model_cls(config).float().eval()
  # Random (not identity) norm weights so a missed norm is caught.
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1 + 0.3 * torch.randn_like(p))
  directory = tmp_path / f"hf_{model_type}"
  model.save_pretrained(directory, safe_serialization=True)
  return model, str(directory)


def left_padded_batch(vocab, lengths, total, seed=0):
  rng = np.random.default_rng(seed)
  tokens = np.zeros((len(lengths), total), np.int32)
  mask = np.zeros((len(lengths), total), np.int32)
  for row, length in enumerate(lengths):
    tokens[row, total - length:] = rng.integers(1, vocab, length)
    mask[row, total - length:] = 1
  return tokens, mask
