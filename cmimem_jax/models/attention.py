"""Attention backends of the decoder.

Two entry points:

* `causal_self_attention` — the no-cache path (training, scoring, prefill
  without a cache): T queries over the same T keys, causal, with padding and
  packed rows described by `[B, T]` segment ids (0 = padding; a token sees
  only earlier tokens of its own segment). No backend builds a `[B, T, T]`
  mask; "splash" and "cudnn" never build `[T, T]` scores either:

  | impl | where | how |
  | "splash" | TPU (`auto`) | Pallas splash-attention kernel, under `shard_map` over the mesh (batch over `data`×`fsdp`, heads over `tensor`); `interpret=True` when the target is the CPU |
  | "cudnn" | GPU (`auto`, bf16/fp16) | `jax.nn.dot_product_attention(implementation="cudnn")`, rows rolled so their real tokens start at 0 (cuDNN takes lengths, not masks) |
  | "per_head" | CPU (`auto`, T ≥ 16) | 128-query blocks, each a `lax.map` of 2-D matmuls over (row, kv head); the block's mask comes from the segment ids |
  | "batched" | CPU decode, fallback | the same blocks as one batched einsum |

* `cached_attention` — decoding over a KV cache with an explicit `[B, T, S]`
  validity mask (T = the few new tokens), always the XLA path;
  `shared_prefix_attention` the same over a prompt cache shared by groups
  of rows plus each row's own cache.
* `grouped_rows_attention` — training over a prompt shared by a group of
  rows on the splash kernel: each packed row is `[prompt; row 1; ...;
  row G]`, and `SharedPrefixMask` lets each row see the prompt and,
  causally, itself (its blocks over the other rows are skipped).

Every backend gives the same numbers on real tokens (tests/models/
test_attention.py); outputs at padding positions are unspecified.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from cmimem_jax.parallel.mesh import BATCH_AXES

ATTENTION_IMPLS = ("auto", "batched", "per_head", "splash", "cudnn")
# Query block of the XLA paths (upper-triangle blocks are skipped).
XLA_QUERY_BLOCK = 128
# The splash kernel's tile along both sequences (MaxText's default); short
# rows use the smallest multiple of 128 that holds them.
SPLASH_BLOCK = 512


def target_platform() -> str:
  """The platform being compiled for: the context mesh's (`jax.set_mesh`),
  which may differ from the host's (an AOT compile for a TPU topology on a
  CPU machine), else the default backend."""
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty and mesh.abstract_device is not None:
    return mesh.abstract_device.platform
  return jax.default_backend()


def resolve_impl(impl: str, queries: int, dtype: jnp.dtype) -> str:
  """The concrete backend for "auto" (see the module table)."""
  if impl not in ATTENTION_IMPLS:
    raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, "
                     f"got {impl!r}")
  if impl != "auto":
    return impl
  platform = target_platform()
  if platform == "tpu":
    return "splash"
  if platform == "gpu":
    # cuDNN's flash kernels take half precision only.
    half = jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
    return "cudnn" if half else "batched"
  return _xla_impl(queries)


def _xla_impl(queries: int) -> str:
  """XLA:CPU's batched dots are slow: a loop of 2-D matmuls for 16+
  queries (prefill, training); decoding is loop-overhead bound: batched."""
  return ("per_head" if jax.default_backend() == "cpu" and queries >= 16
          else "batched")


# --- the XLA paths ------------------------------------------------------------

def _grouped_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                       mask: jax.Array, impl: str) -> jax.Array:
  """q `[B, T, H, D]`, k/v `[B, KV, S, D]`, mask `[B, T, S]` -> `[B, T, H,
  D]` (q's dtype; scores and softmax in float32)."""
  b, t, heads, dim = q.shape
  kv = k.shape[1]
  group = heads // kv
  # [B, KV, G*T, D]: the G query heads sharing a kv head stack on the rows.
  q = q.reshape(b, t, kv, group, dim).transpose(0, 2, 3, 1, 4).reshape(
      b, kv, group * t, dim)
  rows_mask = jnp.tile(mask, (1, group, 1))  # [B, G*T, S]

  def attend(q, k, v, mask):
    scores = jnp.einsum("...md,...sd->...ms", q, k,
                        preferred_element_type=jnp.float32) * dim ** -0.5
    # The most negative float, not -inf: a row with no visible key (a
    # padding query) stays finite.
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("...ms,...sd->...md", probs.astype(v.dtype), v,
                      preferred_element_type=jnp.float32)

  if impl == "per_head":
    flat = lambda x: x.reshape(b * kv, *x.shape[2:])  # noqa: E731
    out = jax.lax.map(lambda a: attend(*a), (
        flat(q), flat(k), flat(v), jnp.repeat(rows_mask, kv, axis=0)))
  else:
    out = attend(q, k, v, rows_mask[:, None])
  out = out.reshape(b, kv, group, t, dim).transpose(0, 3, 1, 2, 4)
  return out.reshape(b, t, heads, dim).astype(q.dtype)


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                     mask: jax.Array, impl: str = "auto") -> jax.Array:
  """Grouped-query attention of T new queries over a cache.

  Args:
    q: `[B, T, H, D]`; k, v: `[B, KV, S, D]` (the cache's head-major
      layout); mask: `[B, T, S]` bool.
    impl: "per_head" or "batched"; anything else resolves like "auto"
      on this platform's XLA path ("per_head" on CPU for T >= 16).

  Returns:
    `[B, T, H, D]` in q's dtype.
  """
  if impl not in ("per_head", "batched"):
    impl = _xla_impl(q.shape[1])
  return _grouped_attention(q, k, v, mask, impl)


def shared_prefix_attention(q: jax.Array, prefix_k: jax.Array,
                            prefix_v: jax.Array, prefix_valid: jax.Array,
                            k: jax.Array, v: jax.Array, mask: jax.Array
                            ) -> jax.Array:
  """Decoding attention over a prompt cache shared by groups of rows, then
  each row's own cache, as one softmax over both.

  The B rows are P groups of B / P consecutive rows continuing the same
  prompt; the prompt's keys are read once per group (the N rollouts of a
  session share one copy of a 20k-token prompt instead of N).

  Args:
    q: `[B, T, H, D]`.
    prefix_k, prefix_v: `[P, KV, Tp, D]`; prefix_valid: `[P, Tp]` bool.
    k, v: `[B, KV, S, D]` the rows' own keys/values; mask: `[B, T, S]`.

  Returns:
    `[B, T, H, D]` in q's dtype (scores and softmax in float32).
  """
  b, t, heads, dim = q.shape
  p, kv = prefix_k.shape[0], k.shape[1]
  group, per_kv = b // p, heads // kv
  scale = dim ** -0.5
  lowest = jnp.finfo(jnp.float32).min
  q = q.reshape(b, t, kv, per_kv, dim)
  shared = jnp.einsum("pntkgd,pksd->pntkgs",
                      q.reshape(p, group, t, kv, per_kv, dim), prefix_k,
                      preferred_element_type=jnp.float32) * scale
  shared = jnp.where(prefix_valid[:, None, None, None, None], shared, lowest)
  shared = shared.reshape(b, t, kv, per_kv, -1)
  own = jnp.einsum("btkgd,bksd->btkgs", q, k,
                   preferred_element_type=jnp.float32) * scale
  own = jnp.where(mask[:, :, None, None], own, lowest)
  top = jnp.maximum(shared.max(-1), own.max(-1))[..., None]
  shared, own = jnp.exp(shared - top), jnp.exp(own - top)
  total = shared.sum(-1) + own.sum(-1)
  out = jnp.einsum("pntkgs,pksd->pntkgd", shared.reshape(
      p, group, t, kv, per_kv, -1).astype(v.dtype), prefix_v,
      preferred_element_type=jnp.float32).reshape(b, t, kv, per_kv, dim)
  out = out + jnp.einsum("btkgs,bksd->btkgd", own.astype(v.dtype), v,
                         preferred_element_type=jnp.float32)
  return (out / total[..., None]).reshape(b, t, heads, dim).astype(q.dtype)


def _xla_causal(q: jax.Array, k: jax.Array, v: jax.Array,
                segment_ids: jax.Array, impl: str) -> jax.Array:
  """Query block i attends to keys `[0, (i + 1)·block)` only, skipping the
  all-masked upper triangle; each block's `[B, block, S]` mask is built
  from the segment ids (exact: masked keys get probability 0 either way)."""
  t = q.shape[1]
  positions = jnp.arange(t)
  k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, KV, T, D]
  outs = []
  for start in range(0, t, XLA_QUERY_BLOCK):
    stop = min(start + XLA_QUERY_BLOCK, t)
    causal = positions[start:stop, None] >= positions[None, :stop]
    same = (segment_ids[:, start:stop, None] ==
            segment_ids[:, None, :stop])
    outs.append(_grouped_attention(q[:, start:stop], k[:, :, :stop],
                                   v[:, :, :stop], causal[None] & same, impl))
  return jnp.concatenate(outs, axis=1)


# --- cuDNN --------------------------------------------------------------------

def _cudnn_causal(q: jax.Array, k: jax.Array, v: jax.Array,
                  segment_ids: jax.Array,
                  implementation: str | None = "cudnn") -> jax.Array:
  """cuDNN flash attention. cuDNN describes padding by lengths from the
  start of the row, so each row is rolled left by its leading padding
  (its real tokens are one contiguous run: one segment per row) and rolled
  back afterwards; RoPE is already applied, so positions are unaffected."""
  t = q.shape[1]
  real = segment_ids != 0
  lead = jnp.argmax(real, axis=1)                        # [B]
  lengths = real.sum(axis=1).astype(jnp.int32)           # [B]
  take = (jnp.arange(t)[None] + lead[:, None]) % t       # [B, T]
  roll = lambda x, idx: jnp.take_along_axis(  # noqa: E731
      x, idx[:, :, None, None], axis=1)
  out = jax.nn.dot_product_attention(
      roll(q, take), roll(k, take), roll(v, take), is_causal=True,
      query_seq_lengths=lengths, key_value_seq_lengths=lengths,
      implementation=implementation)
  back = (jnp.arange(t)[None] - lead[:, None]) % t
  return roll(out, back)


# --- splash (TPU) -------------------------------------------------------------

def _round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def splash_block(length: int) -> int:
  """The kernel tile for rows of `length` tokens."""
  return min(SPLASH_BLOCK, _round_up(length, 128))


def _splash_kernel(heads: int, length: int, block: int, interpret: bool,
                   shared: tuple[int, int] | None = None):
  """Built per trace, not cached: the kernel holds its mask tables as
  arrays, constants of the trace that builds it (a kernel reused by a
  later trace, e.g. remat's or the gradient's, leaks them), and eager
  arrays cannot be made while compiling for a TPU topology on a CPU.
  (`splash_attention_mask_info` caches the tables' NumPy work per mask.)
  `shared`: (prompt, row) lengths of `SharedPrefixMask`; else causal."""
  # Imported here: the Pallas TPU package is only needed on this path.
  from jax.experimental.pallas.ops.tpu.splash_attention import (
      splash_attention_kernel as kernel, splash_attention_mask as masks)
  one = (masks.CausalMask((length, length)) if shared is None
         else shared_prefix_mask(length, *shared))
  mask = masks.MultiHeadMask([one] * heads)
  sizes = kernel.BlockSizes(
      block_q=block, block_kv=block, block_kv_compute=block,
      block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
      block_q_dq=block, block_kv_dq=block)
  return kernel.make_splash_mha(mask, block_sizes=sizes, head_shards=1,
                                q_seq_shards=1, interpret=interpret)


def shared_prefix_mask(length: int, prompt: int, row: int):
  """The splash mask of packed `[prompt; row 1; ...; row G]` sequences
  (`length` = prompt + G·row): a prompt token sees the prompt causally, a
  row's token the whole prompt and its own row causally, never another
  row. Its tiles (each lies in one region when the block divides `prompt`
  and `row`) are classified without evaluating them, so the kernel's mask
  tables for a 68k-token sequence take about a second."""
  return _shared_prefix_mask_class()(length, prompt, row)


@functools.cache
def _shared_prefix_mask_class() -> type:
  """`SharedPrefixMask`, made once (equal masks must share a class: the
  kernel caches its mask tables per mask)."""
  from jax.experimental.pallas.ops.tpu.splash_attention import (
      splash_attention_mask as masks)

  class SharedPrefixMask(masks.Mask):
    """See `shared_prefix_mask`."""

    def __init__(self, length: int, prompt: int, row: int):
      self.length, self.prompt, self.row = length, prompt, row
      self._constant: dict[tuple[int, int, bool], np.ndarray] = {}

    @property
    def shape(self) -> tuple[int, int]:
      return self.length, self.length

    def _region(self, start: int, stop: int) -> int | None:
      """-1 for the prompt, i for row i, None across regions."""
      first, last = (-1 if x < self.prompt else (x - self.prompt) // self.row
                     for x in (start, stop - 1))
      return first if first == last else None

    def __getitem__(self, index) -> np.ndarray:
      q_slice, kv_slice = (slice(*i.indices(self.length)) for i in index)
      q_region = self._region(q_slice.start, q_slice.stop)
      kv_region = self._region(kv_slice.start, kv_slice.stop)
      value = None
      if q_region is not None and kv_region is not None:
        if kv_region == -1 and q_region >= 0:
          value = True  # A row sees the whole prompt.
        elif kv_region != q_region:
          value = False  # Another row, or a row seen from the prompt.
        elif kv_slice.stop - 1 <= q_slice.start:
          value = True  # Causal, wholly below the diagonal.
        elif kv_slice.start > q_slice.stop - 1:
          value = False
      if value is not None:
        key = (q_slice.stop - q_slice.start, kv_slice.stop - kv_slice.start,
               value)
        if key not in self._constant:
          self._constant[key] = np.full(key[:2], value)
        return self._constant[key]
      q = np.arange(q_slice.start, q_slice.stop)[:, None]
      kv = np.arange(kv_slice.start, kv_slice.stop)[None, :]
      same_row = (q >= self.prompt) & (kv >= self.prompt) & (
          (q - self.prompt) // self.row == (kv - self.prompt) // self.row)
      return (kv <= q) & ((kv < self.prompt) | same_row)

    def __eq__(self, other: object) -> bool:
      return isinstance(other, SharedPrefixMask) and (
          other.length, other.prompt, other.row) == (
              self.length, self.prompt, self.row)

    def __hash__(self) -> int:
      return hash((SharedPrefixMask, self.length, self.prompt, self.row))

  return SharedPrefixMask


def _splash_local(q: jax.Array, k: jax.Array, v: jax.Array,
                  segment_ids: jax.Array, *, interpret: bool,
                  shared: tuple[int, int] | None = None) -> jax.Array:
  """One device's rows: q `[b, H, T, D]`, k/v `[b, KV, T, D]` (T a multiple
  of the block), segment ids `[b, T]`."""
  from jax.experimental.pallas.ops.tpu.splash_attention import (
      splash_attention_kernel as kernel)
  length = q.shape[2]
  block = splash_block(length) if shared is None else shared_block(*shared)
  splash = _splash_kernel(q.shape[1], length, block, interpret, shared)
  one_row = lambda q, k, v, s: splash(  # noqa: E731
      q, k, v, segment_ids=kernel.SegmentIds(q=s, kv=s))
  return jax.vmap(one_row)(q, k, v, segment_ids)


def _splash_causal(q: jax.Array, k: jax.Array, v: jax.Array,
                   segment_ids: jax.Array,
                   shared: tuple[int, int] | None = None) -> jax.Array:
  b, t, heads, dim = q.shape
  padded = t if shared else _round_up(t, splash_block(t))
  pad = padded - t
  # The kernel does not scale its scores; float32 keeps the scaling exact.
  q = (q.astype(jnp.float32) * dim ** -0.5).astype(q.dtype)
  # [B, T, N, D] -> [B, N, T', D]; the tail padding is its own segment (-1),
  # so it never attends to (or is seen by) a real token.
  to_kernel = lambda x: jnp.pad(  # noqa: E731
      x, ((0, 0), (0, pad), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
  segment_ids = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, pad)),
                        constant_values=-1)
  args = (to_kernel(q), to_kernel(k), to_kernel(v), segment_ids)
  interpret = target_platform() != "tpu"
  local = functools.partial(_splash_local, interpret=interpret, shared=shared)
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty:
    batch = tuple(a for a in BATCH_AXES if a in mesh.axis_names)
    heads_axis = "tensor" if "tensor" in mesh.axis_names else None
    rows = math.prod(mesh.shape[a] for a in batch)
    if b % rows or (heads_axis and k.shape[2] % mesh.shape[heads_axis]):
      raise ValueError(
          f"splash attention shards {b} rows over {batch} ({rows}) and "
          f"{k.shape[2]} kv heads over {heads_axis!r}: they must divide")
    qkv = P(batch, heads_axis, None, None)
    local = jax.shard_map(local, mesh=mesh,
                          in_specs=(qkv, qkv, qkv, P(batch, None)),
                          out_specs=qkv, check_vma=False)
  out = local(*args)
  return out.transpose(0, 2, 1, 3)[:, :t]


def shared_block(prompt: int, row: int) -> int:
  """The kernel tile of packed `[prompt; rows]` sequences: it must divide
  both lengths (`grouped_rows_layout` pads them to its multiples)."""
  return splash_block(max(prompt, row))


def grouped_rows_layout(prompt: int, row: int) -> tuple[int, int]:
  """(prompt, row) lengths of the packed layout: each rounded up to a
  multiple of `shared_block` (the prompt padded on the left, the rows on
  the right)."""
  block = shared_block(prompt, row)
  return _round_up(prompt, block), _round_up(row, block)


def grouped_rows_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                           segment_ids: jax.Array, prompt: int, row: int
                           ) -> jax.Array:
  """Attention of packed `[prompt; row 1; ...; row G]` sequences on the
  splash kernel (`SharedPrefixMask`): the prompt causal, each row over the
  whole prompt and causally over itself, within segments (0 = padding).

  Args:
    q: `[P, prompt + G·row, H, D]`; k, v: `[P, prompt + G·row, KV, D]`
      (RoPE applied), `prompt` and `row` from `grouped_rows_layout`.
    segment_ids: `[P, prompt + G·row]`: 1 for real tokens, 0 for padding.

  Returns:
    `[P, prompt + G·row, H, D]` in q's dtype.
  """
  if (q.shape[1] - prompt) % row or any(
      n % shared_block(prompt, row) for n in (prompt, row)):
    raise ValueError(f"{q.shape[1]} tokens are not a {prompt}-token prompt "
                     f"and rows of {row} in blocks of "
                     f"{shared_block(prompt, row)}: use grouped_rows_layout")
  return _splash_causal(q, k, v, segment_ids, (prompt, row))


def causal_self_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                          segment_ids: jax.Array, impl: str = "auto"
                          ) -> jax.Array:
  """Causal grouped-query self-attention within segments.

  Args:
    q: `[B, T, H, D]`; k, v: `[B, T, KV, D]` (RoPE applied).
    segment_ids: `[B, T]` int: 0 for padding, else the token's segment
      (packed rows: 1, 2, ...). "cudnn" takes one segment per row.
    impl: a name in `ATTENTION_IMPLS` (see the module table).

  Returns:
    `[B, T, H, D]` in q's dtype.
  """
  impl = resolve_impl(impl, q.shape[1], q.dtype)
  if impl == "splash":
    return _splash_causal(q, k, v, segment_ids)
  if impl == "cudnn":
    return _cudnn_causal(q, k, v, segment_ids)
  return _xla_causal(q, k, v, segment_ids, impl)
