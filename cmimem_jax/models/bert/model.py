"""BERT-family sentence encoder (all-MiniLM-L6-v2) in Flax NNX.

Post-norm transformer encoder (HF `BertModel`): embeddings (word + position
+ token type) -> LayerNorm; per layer self-attention -> dense -> residual
LayerNorm -> GELU MLP -> residual LayerNorm. Layers are stacked and scanned.
Sentence embeddings are the masked mean of the last hidden states, L2
normalised (sentence-transformers' pooling for this model).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx


@dataclasses.dataclass(frozen=True)
class BertConfig:
  vocab_size: int
  hidden_size: int
  num_hidden_layers: int
  num_attention_heads: int
  intermediate_size: int
  max_position_embeddings: int = 512
  type_vocab_size: int = 2
  layer_norm_eps: float = 1e-12
  pad_token_id: int = 0

  @classmethod
  def from_hf(cls, hf: dict[str, Any]) -> BertConfig:
    if hf.get("hidden_act", "gelu") != "gelu":
      raise NotImplementedError(f"hidden_act {hf['hidden_act']!r}")
    if hf.get("position_embedding_type", "absolute") != "absolute":
      raise NotImplementedError("only absolute position embeddings")
    return cls(**{f.name: hf[f.name] for f in dataclasses.fields(cls)
                  if f.name in hf})

  @classmethod
  def from_pretrained(cls, directory: str) -> BertConfig:
    with open(os.path.join(directory, "config.json")) as f:
      return cls.from_hf(json.load(f))


def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array,
               eps: float) -> jax.Array:
  mean = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + eps) * weight + bias


def _zeros(shape: tuple[int, ...]) -> nnx.Param:
  return nnx.Param(jnp.zeros(shape, jnp.float32))


class Bert(nnx.Module):
  """Parameters stacked over layers (`[L, ...]`); weights are `[in, out]`."""

  def __init__(self, config: BertConfig, *, rngs: nnx.Rngs):
    c = config
    h, i, layers = c.hidden_size, c.intermediate_size, c.num_hidden_layers
    normal = lambda *s: nnx.Param(  # noqa: E731
        0.02 * jax.random.normal(rngs.params(), s, jnp.float32))
    self.config = config
    self.word_embeddings = normal(c.vocab_size, h)
    self.position_embeddings = normal(c.max_position_embeddings, h)
    self.token_type_embeddings = normal(c.type_vocab_size, h)
    self.embed_norm_weight = nnx.Param(jnp.ones((h,), jnp.float32))
    self.embed_norm_bias = _zeros((h,))
    for name in ("query", "key", "value", "attention_output"):
      setattr(self, f"{name}_weight", normal(layers, h, h))
      setattr(self, f"{name}_bias", _zeros((layers, h)))
    self.attention_norm_weight = nnx.Param(jnp.ones((layers, h), jnp.float32))
    self.attention_norm_bias = _zeros((layers, h))
    self.intermediate_weight = normal(layers, h, i)
    self.intermediate_bias = _zeros((layers, i))
    self.output_weight = normal(layers, i, h)
    self.output_bias = _zeros((layers, h))
    self.output_norm_weight = nnx.Param(jnp.ones((layers, h), jnp.float32))
    self.output_norm_bias = _zeros((layers, h))

  _LAYER_PARAMS = (
      "query_weight", "query_bias", "key_weight", "key_bias", "value_weight",
      "value_bias", "attention_output_weight", "attention_output_bias",
      "attention_norm_weight", "attention_norm_bias", "intermediate_weight",
      "intermediate_bias", "output_weight", "output_bias",
      "output_norm_weight", "output_norm_bias")

  def __call__(self, tokens: jax.Array, attention_mask: jax.Array
               ) -> jax.Array:
    """Last hidden states `[B, T, H]` for `[B, T]` ids and mask."""
    c = self.config
    b, t = tokens.shape
    heads, dim = c.num_attention_heads, c.hidden_size // c.num_attention_heads
    x = (jnp.take(self.word_embeddings[...], tokens, axis=0)
         + self.position_embeddings[...][None, :t]
         + self.token_type_embeddings[...][0])
    x = layer_norm(x, self.embed_norm_weight[...],
                   self.embed_norm_bias[...], c.layer_norm_eps)
    key_mask = attention_mask.astype(bool)[:, None, None, :]

    def layer(x, p):
      split = lambda y: y.reshape(b, t, heads, dim)  # noqa: E731
      q = split(x @ p["query_weight"] + p["query_bias"])
      k = split(x @ p["key_weight"] + p["key_bias"])
      v = split(x @ p["value_weight"] + p["value_bias"])
      scores = jnp.einsum("bthd,bshd->bhts", q, k) * dim ** -0.5
      scores = jnp.where(key_mask, scores, jnp.finfo(jnp.float32).min)
      attn = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, -1), v)
      attn = attn.reshape(b, t, -1) @ p["attention_output_weight"] + p[
          "attention_output_bias"]
      x = layer_norm(x + attn, p["attention_norm_weight"],
                     p["attention_norm_bias"], c.layer_norm_eps)
      hidden = jax.nn.gelu(x @ p["intermediate_weight"]
                           + p["intermediate_bias"], approximate=False)
      out = hidden @ p["output_weight"] + p["output_bias"]
      return layer_norm(x + out, p["output_norm_weight"],
                        p["output_norm_bias"], c.layer_norm_eps), None

    stacked = {name: getattr(self, name)[...] for name in self._LAYER_PARAMS}
    x, _ = jax.lax.scan(layer, x, stacked)
    return x


def mean_pool(hidden: jax.Array, mask: jax.Array) -> jax.Array:
  """Masked mean over tokens, L2-normalised: `[B, T, H] -> [B, H]`."""
  mask = mask.astype(jnp.float32)[..., None]
  pooled = jnp.sum(hidden * mask, axis=1) / jnp.maximum(jnp.sum(mask, 1), 1e-9)
  return pooled / jnp.maximum(jnp.linalg.norm(pooled, axis=-1, keepdims=True),
                              1e-12)
