"""HF `BertModel` safetensors -> `Bert` (NNX)."""

from __future__ import annotations

import numpy as np
from flax import nnx

from cmimem_jax.models.bert.model import Bert, BertConfig
from cmimem_jax.models.qwen3.params import TensorSource, fill_from_key_map

# ours -> (HF name, "{i}" = layer, transpose)
KEY_MAP: dict[str, tuple[str, bool]] = {
    "word_embeddings": ("embeddings.word_embeddings.weight", False),
    "position_embeddings": ("embeddings.position_embeddings.weight", False),
    "token_type_embeddings": ("embeddings.token_type_embeddings.weight", False),
    "embed_norm_weight": ("embeddings.LayerNorm.weight", False),
    "embed_norm_bias": ("embeddings.LayerNorm.bias", False),
    "query_weight": ("encoder.layer.{i}.attention.self.query.weight", True),
    "query_bias": ("encoder.layer.{i}.attention.self.query.bias", False),
    "key_weight": ("encoder.layer.{i}.attention.self.key.weight", True),
    "key_bias": ("encoder.layer.{i}.attention.self.key.bias", False),
    "value_weight": ("encoder.layer.{i}.attention.self.value.weight", True),
    "value_bias": ("encoder.layer.{i}.attention.self.value.bias", False),
    "attention_output_weight": (
        "encoder.layer.{i}.attention.output.dense.weight", True),
    "attention_output_bias": (
        "encoder.layer.{i}.attention.output.dense.bias", False),
    "attention_norm_weight": (
        "encoder.layer.{i}.attention.output.LayerNorm.weight", False),
    "attention_norm_bias": (
        "encoder.layer.{i}.attention.output.LayerNorm.bias", False),
    "intermediate_weight": ("encoder.layer.{i}.intermediate.dense.weight",
                            True),
    "intermediate_bias": ("encoder.layer.{i}.intermediate.dense.bias", False),
    "output_weight": ("encoder.layer.{i}.output.dense.weight", True),
    "output_bias": ("encoder.layer.{i}.output.dense.bias", False),
    "output_norm_weight": ("encoder.layer.{i}.output.LayerNorm.weight", False),
    "output_norm_bias": ("encoder.layer.{i}.output.LayerNorm.bias", False),
}


def load_bert(directory: str) -> Bert:
  """Loads a HF BERT checkpoint folder (e.g. all-MiniLM-L6-v2)."""
  config = BertConfig.from_pretrained(directory)
  source = TensorSource(directory)
  # BertForX checkpoints prefix the encoder with "bert.".
  prefix = "bert." if any(k.startswith("bert.") for k in source.weight_map) \
      else ""
  model = nnx.eval_shape(lambda: Bert(config, rngs=nnx.Rngs(0)))

  def get(name: str) -> np.ndarray | None:
    return source.get(prefix + name) if prefix + name in source else None

  return fill_from_key_map(model, KEY_MAP, get, config.num_hidden_layers)
