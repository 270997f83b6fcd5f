"""Random tiny `transformers` causal LMs saved with `save_pretrained`, the
references the model tests compare our decoders against (logits, the HF
loader, vLLM's weight names), and left-padded token batches to feed both.
"""

from __future__ import annotations

import os

import numpy as np


def hf_causal_lm(directory: str | os.PathLike, model_type: str = "qwen3",
                 **overrides) -> tuple:
  """A random tiny HF causal LM (`model_type` "qwen3" or "llama", config
  fields overridden by `overrides`) saved under `directory`; returns
  (the torch model in fp32 eval mode, the checkpoint's directory).

  The RMSNorm scales are random, not ones, so a norm left out or applied
  twice changes the logits."""
  import torch
  import transformers
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
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1 + 0.3 * torch.randn_like(p))
  path = os.path.join(directory, f"hf_{model_type}")
  model.save_pretrained(path, safe_serialization=True)
  return model, path


def left_padded_batch(vocab: int, lengths: list[int], total: int,
                      seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """Random tokens in [1, vocab) of each row's length in `lengths`,
  right-aligned in `total` columns: (tokens [B, total] int32, mask [B,
  total] int32, 1 on the tokens)."""
  rng = np.random.default_rng(seed)
  tokens = np.zeros((len(lengths), total), np.int32)
  mask = np.zeros((len(lengths), total), np.int32)
  for row, length in enumerate(lengths):
    tokens[row, total - length:] = rng.integers(1, vocab, length)
    mask[row, total - length:] = 1
  return tokens, mask
