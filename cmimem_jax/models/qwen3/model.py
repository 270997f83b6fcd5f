"""Qwen3 decoder (and the Llama family with `qk_norm=False`) in Flax NNX.

Architecture (SPEC §2.1): pre-norm blocks, RMSNorm -> GQA attention with
per-head RMSNorm on q and k *before* rotate-half RoPE -> residual -> RMSNorm
-> SwiGLU MLP -> residual; final RMSNorm; LM head tied to the embedding or
not. Layer parameters are stacked on a leading `[L]` axis and the stack is
run by `jax.lax.scan`, so a 36-layer model compiles one layer. Norms, RoPE
tables, softmax and logits are float32 whatever the compute dtype.

The KV cache (`KVCache`) is a pytree of `[L, B, S, kv_heads, head_dim]`
arrays written at a shared position, which is what left-padded batched
decoding needs.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from cmimem_jax import storage
from cmimem_jax.models.attention import (ATTENTION_IMPLS, cached_attention,
                                        causal_self_attention,
                                        grouped_rows_attention,
                                        grouped_rows_layout, resolve_impl,
                                        shared_prefix_attention)

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16,
           "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
  """Model hyper-parameters (names follow HF `config.json`)."""
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int
  rms_norm_eps: float = 1e-6
  rope_theta: float = 1_000_000.0
  tie_word_embeddings: bool = False
  qk_norm: bool = True  # False: Llama family (SmolLM2).
  attention_bias: bool = False
  max_position_embeddings: int = 32768
  bos_token_id: int | None = None
  eos_token_id: int | tuple[int, ...] | None = None
  # Runtime policy (not in HF configs).
  dtype: str = "float32"        # Compute dtype (bfloat16 on accelerators).
  param_dtype: str = "float32"  # Storage dtype of parameters.
  remat: str = "none"           # "none" | "full" | "dots" (save matmuls).
  # `models.attention.ATTENTION_IMPLS`. "auto": the Pallas splash kernel on
  # TPU, cuDNN flash attention on GPU (bf16), and on CPU "per_head" (a loop
  # of 2-D matmuls per (row, kv head), 3.5x faster on XLA:CPU, whose
  # batched dots are slow) for 16+ queries, else "batched" (one einsum).
  # Cached decoding always takes an XLA path.
  attention_impl: str = "auto"
  # How cached decoding runs the layers. "scan": `lax.scan` over the [L]
  # stack (one compiled layer). "unrolled": a Python loop over per-layer
  # weight copies sliced once per `generate` call — XLA:CPU copies each
  # scanned layer's weights out of the stack every step (decoding is
  # weight-bandwidth bound, so that copy costs ~30 %), at the price of a
  # second copy of the layer weights while generating. "auto": unrolled on
  # CPU, scan on GPU/TPU (memory is scarcer there).
  decode_loop: str = "auto"

  def __post_init__(self):
    if self.num_attention_heads % self.num_key_value_heads:
      raise ValueError("num_attention_heads must be a multiple of "
                       "num_key_value_heads")
    if self.remat not in ("none", "full", "dots"):
      raise ValueError(f"remat must be none/full/dots, got {self.remat!r}")
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, "
                       f"got {self.attention_impl!r}")
    if self.decode_loop not in ("auto", "scan", "unrolled"):
      raise ValueError("decode_loop must be auto/scan/unrolled, got "
                       f"{self.decode_loop!r}")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in _DTYPES:
        raise ValueError(f"{name} must be one of {sorted(_DTYPES)}")

  @property
  def compute_dtype(self) -> Any:
    return _DTYPES[self.dtype]

  @property
  def storage_dtype(self) -> Any:
    return _DTYPES[self.param_dtype]

  @property
  def unrolled_decode(self) -> bool:
    """Whether cached decoding loops over per-layer weights (see
    `decode_loop`)."""
    if self.decode_loop == "auto":
      return jax.default_backend() == "cpu"
    return self.decode_loop == "unrolled"

  @classmethod
  def from_hf(cls, hf: dict[str, Any], **overrides: Any) -> Qwen3Config:
    """From a HF `config.json` dict (Qwen3*, Llama*, Mistral-style)."""
    model_type = hf.get("model_type", "qwen3")
    heads = hf["num_attention_heads"]
    eos = hf.get("eos_token_id")
    # transformers >= 5 nests RoPE settings in `rope_parameters`; older
    # checkpoints (Qwen3-4B-2507 as released) use `rope_theta`/`rope_scaling`.
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
      raise NotImplementedError(f"RoPE scaling {rope} is not supported")
    theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
    values = dict(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_hidden_layers=hf["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qk_norm=model_type.startswith("qwen3"),
        attention_bias=bool(hf.get("attention_bias", False)),
        max_position_embeddings=hf.get("max_position_embeddings", 32768),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos)
    values.update(overrides)
    return cls(**values)

  @classmethod
  def from_pretrained(cls, directory: str, **overrides: Any) -> Qwen3Config:
    """The architecture in `directory/config.json` (local or `gs://`:
    `tools/plan.py` reads a bucket's checkpoint without its weights)."""
    return cls.from_hf(json.loads(storage.path(
        storage.join(directory, "config.json")).read_text()), **overrides)

  def to_hf(self, model_type: str = "") -> dict[str, Any]:
    """A HF `config.json` dict transformers can load."""
    model_type = model_type or ("qwen3" if self.qk_norm else "llama")
    arch = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}
    eos = self.eos_token_id
    return {
        "architectures": [arch.get(model_type, "Qwen3ForCausalLM")],
        "model_type": model_type, "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_hidden_layers,
        "num_attention_heads": self.num_attention_heads,
        "num_key_value_heads": self.num_key_value_heads,
        "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps,
        "rope_theta": self.rope_theta,
        "rope_parameters": {"rope_type": "default",
                            "rope_theta": self.rope_theta},
        "tie_word_embeddings": self.tie_word_embeddings,
        "attention_bias": self.attention_bias, "hidden_act": "silu",
        "max_position_embeddings": self.max_position_embeddings,
        "bos_token_id": self.bos_token_id,
        "eos_token_id": list(eos) if isinstance(eos, tuple) else eos,
        "torch_dtype": "float32",
    }


PRESETS: dict[str, dict[str, Any]] = {
    # Qwen3-4B-Instruct-2507 (the paper's policy).
    "qwen3_4b": dict(vocab_size=151936, hidden_size=2560,
                     intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, rope_theta=5_000_000.0,
                     tie_word_embeddings=True, max_position_embeddings=262144,
                     eos_token_id=151645),
    "qwen3_0p6b": dict(vocab_size=151936, hidden_size=1024,
                       intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, rope_theta=1_000_000.0,
                       tie_word_embeddings=True, max_position_embeddings=40960,
                       eos_token_id=151645),
    # Qwen3-Embedding-0.6B shares the 0.6B decoder.
    "smollm2_135m": dict(vocab_size=49152, hidden_size=576,
                         intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3,
                         head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, qk_norm=False,
                         max_position_embeddings=8192, eos_token_id=2),
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=24, rope_theta=10000.0,
                 tie_word_embeddings=True, max_position_embeddings=512),
}


def preset(name: str, **overrides: Any) -> Qwen3Config:
  if name not in PRESETS:
    raise KeyError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
  return Qwen3Config(**{**PRESETS[name], **overrides})


# --- functional pieces ------------------------------------------------------

def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """RMSNorm in float32, returned in x's dtype."""
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (weight.astype(jnp.float32) * x32).astype(x.dtype)


def rope_tables(positions: jax.Array, head_dim: int, theta: float
                ) -> tuple[jax.Array, jax.Array]:
  """cos, sin `[B, T, head_dim]` (float32) for rotate-half RoPE."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32)
                              / head_dim))
  freqs = positions.astype(jnp.float32)[..., None] * inv_freq
  angles = jnp.concatenate([freqs, freqs], axis=-1)
  return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """x `[B, T, H, D]`; rotate-half convention (HF Llama/Qwen)."""
  x32 = x.astype(jnp.float32)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
  out = x32 * cos[:, :, None, :] + rotated * sin[:, :, None, :]
  return out.astype(x.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
  """Keys/values `[L, S, kv_heads, B, head_dim]`; `valid` `[B, S]` marks
  written, non-padding slots.

  Sequence-major with the rows next to head_dim: the physical layout the
  TPU compiler picks for a decoding loop over the cache, so the donated
  cache is updated in place instead of being relaid out (two extra copies)
  around the loop.

  In per-layer form (`per_layer()`, used by the unrolled decode loop) keys
  and values are L-tuples of `[B, S, kv_heads, head_dim]` arrays, so each
  layer's slot is updated in place without slicing the stack.
  """
  keys: jax.Array | tuple[jax.Array, ...]
  values: jax.Array | tuple[jax.Array, ...]
  valid: jax.Array

  def per_layer(self) -> KVCache:
    return KVCache(tuple(self.keys), tuple(self.values), self.valid)

  def stacked(self) -> KVCache:
    return KVCache(jnp.stack(self.keys), jnp.stack(self.values), self.valid)

  @classmethod
  def zeros(cls, config: Qwen3Config, batch: int, length: int) -> KVCache:
    shape = (config.num_hidden_layers, length, config.num_key_value_heads,
             batch, config.head_dim)
    return cls(jnp.zeros(shape, config.compute_dtype),
               jnp.zeros(shape, config.compute_dtype),
               jnp.zeros((batch, length), bool))


# --- modules ----------------------------------------------------------------

def _param(rngs: nnx.Rngs, shape: tuple[int, ...], dtype: Any,
           scale: float | None = 0.02) -> nnx.Param:
  if scale is None:  # Norm weights start at one.
    return nnx.Param(jnp.ones(shape, dtype))
  return nnx.Param(scale * jax.random.normal(rngs.params(), shape, dtype))


class DecoderLayers(nnx.Module):
  """All transformer blocks, parameters stacked on a leading `[L]` axis.

  Weight layout is `[in, out]` (x @ w); `params.py` maps HF `[out, in]`.
  """

  def __init__(self, config: Qwen3Config, rngs: nnx.Rngs):
    c, dt = config, config.storage_dtype
    layers, hid = c.num_hidden_layers, c.hidden_size
    q_dim = c.num_attention_heads * c.head_dim
    kv_dim = c.num_key_value_heads * c.head_dim
    self.input_norm = _param(rngs, (layers, hid), dt, None)
    self.post_attention_norm = _param(rngs, (layers, hid), dt, None)
    self.q_proj = _param(rngs, (layers, hid, q_dim), dt)
    self.k_proj = _param(rngs, (layers, hid, kv_dim), dt)
    self.v_proj = _param(rngs, (layers, hid, kv_dim), dt)
    self.o_proj = _param(rngs, (layers, q_dim, hid), dt)
    if c.attention_bias:
      self.q_bias = nnx.Param(jnp.zeros((layers, q_dim), dt))
      self.k_bias = nnx.Param(jnp.zeros((layers, kv_dim), dt))
      self.v_bias = nnx.Param(jnp.zeros((layers, kv_dim), dt))
    if c.qk_norm:
      self.q_norm = _param(rngs, (layers, c.head_dim), dt, None)
      self.k_norm = _param(rngs, (layers, c.head_dim), dt, None)
    self.gate_proj = _param(rngs, (layers, hid, c.intermediate_size), dt)
    self.up_proj = _param(rngs, (layers, hid, c.intermediate_size), dt)
    self.down_proj = _param(rngs, (layers, c.intermediate_size, hid), dt)


def head_major(buffer: jax.Array) -> jax.Array:
  """A layer's cache `[S, KV, B, D]` as the attention reads it, `[B, KV, S,
  D]` (XLA folds the transpose into the matmuls)."""
  return buffer.transpose(2, 1, 0, 3)


def _project_qkv(config: Qwen3Config, p: dict[str, jax.Array], x: jax.Array,
                 cos: jax.Array, sin: jax.Array
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """A block's attention inputs: x `[B, T, H]` -> q `[B, T, heads, D]`, k / v
  `[B, T, kv_heads, D]` (pre-norm, projections, q/k norm, RoPE)."""
  c, dt = config, config.compute_dtype
  b, t, _ = x.shape
  w = lambda name: p[name].astype(dt)  # noqa: E731
  h = rms_norm(x, p["input_norm"], c.rms_norm_eps)
  q, k, v = h @ w("q_proj"), h @ w("k_proj"), h @ w("v_proj")
  if c.attention_bias:
    q, k, v = q + w("q_bias"), k + w("k_bias"), v + w("v_bias")
  q = q.reshape(b, t, c.num_attention_heads, c.head_dim)
  k = k.reshape(b, t, c.num_key_value_heads, c.head_dim)
  v = v.reshape(b, t, c.num_key_value_heads, c.head_dim)
  if c.qk_norm:
    q = rms_norm(q, p["q_norm"], c.rms_norm_eps)
    k = rms_norm(k, p["k_norm"], c.rms_norm_eps)
  return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def _finish_block(config: Qwen3Config, p: dict[str, jax.Array], x: jax.Array,
                  attn: jax.Array) -> jax.Array:
  """The rest of a block after attention: x `[B, T, H]`, attn `[B, T, heads,
  D]` -> output projection + residual, then the SwiGLU MLP + residual."""
  c, dt = config, config.compute_dtype
  w = lambda name: p[name].astype(dt)  # noqa: E731
  b, t, _ = x.shape
  x = x + attn.reshape(b, t, -1) @ w("o_proj")
  h = rms_norm(x, p["post_attention_norm"], c.rms_norm_eps)
  return x + (jax.nn.silu(h @ w("gate_proj")) * (h @ w("up_proj"))) @ w(
      "down_proj")


def _layer(config: Qwen3Config, p: dict[str, jax.Array], x: jax.Array,
           cos: jax.Array, sin: jax.Array, mask: jax.Array | None,
           segments: jax.Array,
           cache_kv: tuple[jax.Array, jax.Array, jax.Array | None] | None,
           write_index: jax.Array | int | None,
           prefix: tuple[jax.Array, jax.Array, jax.Array] | None = None):
  """One block. x `[B, T, H]`; `mask` the `[B, T, S]` cache mask of a
  decoding step, None when the T tokens attend only to themselves (no
  cache, or a prefill at index 0); `segments` `[B, T]` segment ids;
  `prefix` this layer's shared-prefix (keys, values, valid), attended
  before the cache. `cache_kv`: (keys, values, layer): this layer's
  `[S, KV, B, D]` buffers (layer None), or the `[L, S, KV, B, D]` stacks
  and this layer's index, written in place (one token per step, not a
  copy of the layer's cache). Returns (x, (keys, values) written)."""
  c = config
  q, k, v = _project_qkv(c, p, x, cos, sin)
  written, attended = None, None
  if cache_kv is not None:
    *buffers, layer = cache_kv
    new_kv = (k.transpose(1, 2, 0, 3), v.transpose(1, 2, 0, 3))
    if layer is None:
      written = tuple(jax.lax.dynamic_update_slice_in_dim(
          buffer, new, write_index, axis=0)
          for buffer, new in zip(buffers, new_kv))
      attended = written
    else:
      zero = jnp.zeros((), jnp.int32)
      written = tuple(jax.lax.dynamic_update_slice(
          buffer, new[None], (layer, write_index, zero, zero, zero))
          for buffer, new in zip(buffers, new_kv))
      attended = tuple(jax.lax.dynamic_index_in_dim(buffer, layer, 0, False)
                       for buffer in written)
    attended = tuple(head_major(buffer) for buffer in attended)
  if mask is None:
    attn = causal_self_attention(q, k, v, segments, c.attention_impl)
  elif prefix is not None:
    attn = shared_prefix_attention(q, head_major(prefix[0]),
                                   head_major(prefix[1]), prefix[2],
                                   *attended, mask)
  else:
    attn = cached_attention(q, *attended, mask, c.attention_impl)
  return _finish_block(c, p, x, attn), written


class Qwen3(nnx.Module):
  """Qwen3 / Llama causal LM (set `lm_head=False` for the embedding model)."""

  def __init__(self, config: Qwen3Config, *, rngs: nnx.Rngs,
               lm_head: bool = True):
    self.config = config
    dt = config.storage_dtype
    self.embed = _param(rngs, (config.vocab_size, config.hidden_size), dt)
    self.layers = DecoderLayers(config, rngs)
    self.final_norm = _param(rngs, (config.hidden_size,), dt, None)
    self.lm_head = (_param(rngs, (config.hidden_size, config.vocab_size), dt)
                    if lm_head and not config.tie_word_embeddings else None)
    self.has_lm_head = lm_head

  def _stacked(self) -> dict[str, jax.Array]:
    return {name: value[...] for name, value in vars(self.layers).items()
            if isinstance(value, nnx.Param)}

  def layer_params(self) -> tuple[dict[str, jax.Array], ...]:
    """Per-layer parameter dicts sliced off the `[L]` stack (copies): the
    `layers` argument of `hidden_states` for the unrolled decode loop."""
    stacked = self._stacked()
    return tuple({name: value[i] for name, value in stacked.items()}
                 for i in range(self.config.num_hidden_layers))

  def hidden_states(self, tokens: jax.Array, positions: jax.Array,
                    attention_mask: jax.Array, cache: KVCache | None = None,
                    cache_index: jax.Array | int = 0,
                    layers: tuple[dict[str, jax.Array], ...] | None = None,
                    prefix: KVCache | None = None,
                    ) -> tuple[jax.Array, KVCache | None]:
    """Final-norm hidden states `[B, T, H]`.

    Args:
      tokens: `[B, T]` int ids.
      positions: `[B, T]` RoPE positions (from the mask under left padding).
      attention_mask: `[B, T]` 1 for real tokens, 0 for padding. Without a
        cache it may also number packed segments (1, 2, ...; a token attends
        only within its segment; pass each segment's `positions`).
      cache: Optional KV cache; the T new keys/values are written at
        `cache_index` and attention covers every valid cache slot.
      cache_index: Where the new tokens go in the cache. A Python int 0 is a
        prefill: the tokens attend to themselves only (what the cache held
        is causally invisible to them), through `causal_self_attention`.
      layers: `layer_params()` to run the layers as an unrolled loop over
        these (with `cache` in per-layer form) instead of scanning the stack.
      prefix: A read-only cache of P shared prompts (`[L, P, Tp, ...]`, in
        the same form as `cache`), attended by every decoding step before
        `cache`: row b continues prompt `b // (B / P)` (`cache` then holds
        only the rows' own tokens, and `positions` continue the prompts').

    Returns:
      `(hidden [B, T, H], updated cache or None)`.
    """
    c = self.config
    x = jnp.take(self.embed[...], tokens, axis=0).astype(c.compute_dtype)
    cos, sin = rope_tables(positions, c.head_dim, c.rope_theta)
    t = tokens.shape[1]
    # Segment ids, not a [B, T, T] mask: each backend builds what it needs.
    segments = attention_mask.astype(jnp.int32)
    mask, valid = None, None
    if cache is not None:
      real = attention_mask.astype(bool)
      valid = jax.lax.dynamic_update_slice_in_dim(cache.valid, real,
                                                  cache_index, axis=1)
      # A prefill at a static index 0 sees only its own T keys (causality
      # hides every later slot): self-attention, no [B, T, S] mask.
      if not (isinstance(cache_index, int) and cache_index == 0):
        s = valid.shape[1]
        key_pos = jnp.arange(s)[None, :]
        query_pos = cache_index + jnp.arange(t)[:, None]
        mask = (key_pos <= query_pos)[None] & valid[:, None, :]

    if prefix is not None and mask is None:
      raise ValueError("a shared prefix is attended by decoding steps only "
                       "(a traced cache_index)")

    def layer(x, p, kv, prefix_kv=None):
      shared = None if prefix_kv is None else (*prefix_kv, prefix.valid)
      return _layer(c, p, x, cos, sin, mask, segments, kv,
                    None if cache is None else cache_index, shared)

    layer = _rematerialised(c, layer)
    if layers is not None:
      if cache is None or not isinstance(cache.keys, tuple):
        raise ValueError("the unrolled layer loop takes a per-layer cache "
                         "(KVCache.per_layer())")
      keys, values = list(cache.keys), list(cache.values)
      for i, p in enumerate(layers):
        shared = None if prefix is None else (prefix.keys[i], prefix.values[i])
        x, (keys[i], values[i]) = layer(x, p, (keys[i], values[i], None),
                                        shared)
      new_cache = KVCache(tuple(keys), tuple(values), valid)
    elif cache is None:
      def body(x, p):
        x, _ = layer(x, p, None)
        return x, None
      x, _ = jax.lax.scan(body, x, self._stacked())
      new_cache = None
    else:
      # The stacked cache is carried and each layer writes its new tokens
      # into it in place (scanning it as xs -> ys would build a second
      # whole cache).
      def body(carry, inputs):
        x, keys, values = carry
        p, index, shared = inputs
        x, (keys, values) = layer(x, p, (keys, values, index), shared)
        return (x, keys, values), None
      shared = None if prefix is None else (prefix.keys, prefix.values)
      (x, keys, values), _ = jax.lax.scan(
          body, (x, cache.keys, cache.values),
          (self._stacked(), jnp.arange(c.num_hidden_layers), shared))
      new_cache = KVCache(keys, values, valid)
    return rms_norm(x, self.final_norm[...], c.rms_norm_eps), new_cache

  def shared_prompt_hidden_states(
      self, prompt_tokens: jax.Array, prompt_mask: jax.Array,
      tokens: jax.Array, positions: jax.Array, mask: jax.Array
  ) -> tuple[jax.Array, jax.Array]:
    """Final-norm hidden states of P prompts and of the B rows continuing
    them, each prompt computed once (row b continues prompt `b // (B / P)`:
    the G rollouts of one prompt).

    The training-time counterpart of decoding with `prefix`: a row's tokens
    attend to its prompt's valid tokens and causally to its own, which is
    the attention the row `[prompt; tokens]` gets in `hidden_states`, so
    the hidden states are the same, at `P·Tp + B·T` token columns of work
    instead of `B·(Tp + T)` (and the gradient reaches the prompt's keys
    and values once per group, summed over its rows).

    Args:
      prompt_tokens / prompt_mask: `[P, Tp]` (left-padded).
      tokens / mask: `[B, T]` the continuations (right-padded), B a
        multiple of P.
      positions: `[B, T]` their RoPE positions (continuing the prompts').

    On the splash backend (TPU) each prompt and its G rows run as one
    packed sequence `[prompt; row 1; ...; row G]` whose attention mask
    (`attention.grouped_rows_attention`) gives each row the prompt and
    itself; elsewhere the rows attend over their prompt's keys through an
    XLA `[T, Tp + T]` score block.

    Returns:
      `(prompt hidden [P, Tp, H], hidden [B, T, H])`.
    """
    c = self.config
    if tokens.shape[0] % prompt_tokens.shape[0]:
      raise ValueError(f"{tokens.shape[0]} rows do not continue "
                       f"{prompt_tokens.shape[0]} prompts in equal groups")
    if resolve_impl(c.attention_impl, tokens.shape[1],
                    c.compute_dtype) == "splash":
      return self._packed_hidden_states(prompt_tokens, prompt_mask, tokens,
                                        positions, mask)
    embed = self.embed[...]
    prompt_x = jnp.take(embed, prompt_tokens, axis=0).astype(c.compute_dtype)
    x = jnp.take(embed, tokens, axis=0).astype(c.compute_dtype)
    prompt_rope = rope_tables(positions_from_mask(prompt_mask), c.head_dim,
                              c.rope_theta)
    rope = rope_tables(positions, c.head_dim, c.rope_theta)
    b, t = tokens.shape
    group = b // prompt_tokens.shape[0]
    causal = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]
    # Row b's queries see its prompt's valid keys, then its own causally.
    prompt_visible = jnp.repeat(prompt_mask.astype(bool), group, axis=0)
    visible = jnp.concatenate([
        jnp.broadcast_to(prompt_visible[:, None, :],
                         (b, t, prompt_visible.shape[1])),
        causal[None] & mask.astype(bool)[:, None, :]], axis=2)
    # [B, KV, Tp + T, D]: each row's prompt keys (a broadcast: the
    # gradient of the copies sums into the one prompt), then its own.
    row_keys = lambda prompt, own: jnp.concatenate(  # noqa: E731
        [jnp.repeat(prompt, group, axis=0), own], axis=1).transpose(0, 2, 1, 3)

    def layer(carry, p):
      prompt_x, x = carry
      pq, pk, pv = _project_qkv(c, p, prompt_x, *prompt_rope)
      q, k, v = _project_qkv(c, p, x, *rope)
      prompt_attn = causal_self_attention(pq, pk, pv,
                                          prompt_mask.astype(jnp.int32),
                                          c.attention_impl)
      attn = cached_attention(q, row_keys(pk, k), row_keys(pv, v), visible,
                              c.attention_impl)
      return (_finish_block(c, p, prompt_x, prompt_attn),
              _finish_block(c, p, x, attn)), None

    (prompt_x, x), _ = jax.lax.scan(_rematerialised(c, layer), (prompt_x, x),
                                    self._stacked())
    final = self.final_norm[...]
    return (rms_norm(prompt_x, final, c.rms_norm_eps),
            rms_norm(x, final, c.rms_norm_eps))

  def _packed_hidden_states(
      self, prompt_tokens: jax.Array, prompt_mask: jax.Array,
      tokens: jax.Array, positions: jax.Array, mask: jax.Array
  ) -> tuple[jax.Array, jax.Array]:
    """`shared_prompt_hidden_states` on the splash kernel: each prompt
    (left-padded to the kernel's block) followed by its G rows (each
    right-padded to the block) as one sequence, padding its own segment."""
    c = self.config
    (p, tp), (b, t) = prompt_tokens.shape, tokens.shape
    group = b // p
    prompt_len, row_len = grouped_rows_layout(tp, t)

    def pack(prompt_part: jax.Array, rows_part: jax.Array) -> jax.Array:
      """`[P, Tp]` and `[B, T]` -> `[P, prompt_len + G·row_len]`."""
      left = jnp.pad(prompt_part, ((0, 0), (prompt_len - tp, 0)))
      right = jnp.pad(rows_part, ((0, 0), (0, row_len - t)))
      return jnp.concatenate([left, right.reshape(p, group * row_len)], 1)

    segments = pack(prompt_mask, mask).astype(jnp.int32)
    x = jnp.take(self.embed[...], pack(prompt_tokens, tokens), axis=0).astype(
        c.compute_dtype)
    cos, sin = rope_tables(pack(positions_from_mask(prompt_mask), positions),
                           c.head_dim, c.rope_theta)

    def layer(x, p):
      q, k, v = _project_qkv(c, p, x, cos, sin)
      attn = grouped_rows_attention(q, k, v, segments, prompt_len, row_len)
      return _finish_block(c, p, x, attn), None

    x, _ = jax.lax.scan(_rematerialised(c, layer), x, self._stacked())
    x = rms_norm(x, self.final_norm[...], c.rms_norm_eps)
    rows = x[:, prompt_len:].reshape(p, group, row_len, -1)[:, :, :t]
    return x[:, prompt_len - tp:prompt_len], rows.reshape(b, t, -1)

  def logits(self, hidden: jax.Array) -> jax.Array:
    """float32 `[..., V]` logits from hidden states."""
    hidden = hidden.astype(jnp.float32)
    if self.lm_head is None:  # Tied: contract with the embedding directly.
      return jnp.einsum("...h,vh->...v", hidden,
                        self.embed[...].astype(jnp.float32))
    return jnp.einsum("...h,hv->...v", hidden,
                      self.lm_head[...].astype(jnp.float32))

  def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
               attention_mask: jax.Array | None = None,
               cache: KVCache | None = None, cache_index: jax.Array | int = 0,
               layers: tuple[dict[str, jax.Array], ...] | None = None,
               prefix: KVCache | None = None,
               ) -> tuple[jax.Array, KVCache | None]:
    """Logits `[B, T, V]` (float32) and the updated cache (arguments as
    `hidden_states`)."""
    if attention_mask is None:
      attention_mask = jnp.ones(tokens.shape, jnp.int32)
    if positions is None:
      positions = positions_from_mask(attention_mask)
    hidden, cache = self.hidden_states(tokens, positions, attention_mask,
                                       cache, cache_index, layers, prefix)
    return self.logits(hidden), cache


def _rematerialised(config: Qwen3Config, layer):
  """`layer` under the config's rematerialisation policy."""
  if config.remat == "none":
    return layer
  policy = (jax.checkpoint_policies.dots_with_no_batch_dims_saveable
            if config.remat == "dots" else None)
  return jax.checkpoint(layer, policy=policy)


def positions_from_mask(mask: jax.Array) -> jax.Array:
  """RoPE positions for left- or right-padded rows: count of real tokens
  before each position (padding gets 0)."""
  mask = mask.astype(jnp.int32)
  return jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0) * mask
