"""CMI for many operations on a few banks, using the structure of the work.

In a GRPO step the N rollouts of a session share `M_{t-1}` and `e_C`. Per
bank, the retrieval scores of every operation (`[e_C; E_new; E_old] V̂ᵀ`)
and the Gram matrix `V̂V̂ᵀ` of all entries are large GEMMs computed once;
each operation's conditioning-set Gram and alignments are then gathered
from them instead of being recomputed by small per-operation matmuls. The
residuals themselves use the same anchored solve as `residual_cmi`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from cmimem_jax.cmi.conditioning import ConditioningConfig, conditioning_sets
from cmimem_jax.cmi.kernel import (check_finite, choose_anchors, l2_normalize,
                                   partial_correlation, solve_corrections)

_HIGHEST = jax.lax.Precision.HIGHEST


def _normalize_all(bank_vectors: jax.Array, entry_valid: jax.Array,
                   e_ctx: jax.Array, e_new: jax.Array, e_old: jax.Array):
  """Unit rows, in a program of their own so that every later use reads the
  same bits (equal input rows give equal unit rows: one reduction code)."""
  vectors = l2_normalize(bank_vectors) * entry_valid[..., None]
  return vectors, l2_normalize(e_ctx), l2_normalize(e_new), l2_normalize(e_old)


def _gather_rows(table: jax.Array, index: jax.Array) -> jax.Array:
  """`table[b, index[b, ...]]` for `table` `[Bk, M, ...]`, `index` `[Bk, ...]`.

  A gather batched over banks: no broadcast of the table over the index
  dimensions, and banks sharded over devices stay local.
  """
  return jax.vmap(lambda rows, i: jnp.take(rows, i, axis=0))(table, index)


def _gather_pairs(matrix: jax.Array, index: jax.Array) -> jax.Array:
  """`matrix[b, index[b, o, i], index[b, o, j]]` -> `[Bk, O, N, N]`."""
  bk, m = matrix.shape[:2]
  pairs = index[..., :, None] * m + index[..., None, :]  # [Bk, O, N, N]
  return _gather_rows(matrix.reshape(bk, m * m), pairs)


def _select(vectors, entry_valid, recent, e_ctx, e_new, e_old, has_old, *,
            config: ConditioningConfig):
  """Retrieval scores (bank-level GEMMs) and conditioning sets."""
  score = functools.partial(jnp.einsum, "bqd,bmd->bqm", precision=_HIGHEST)
  s_ctx = score(e_ctx[:, None], vectors)[:, 0]  # [Bk, M]
  s_new, s_old = score(e_new, vectors), score(e_old, vectors)  # [Bk, O, M]
  index, mask = conditioning_sets(s_ctx, s_new, s_old, has_old, entry_valid,
                                  recent, config)
  return s_ctx, s_new, s_old, index, mask


def _union(index: np.ndarray, mask: np.ndarray, multiple: int = 32
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Per bank, the entries any conditioning set uses (padded to a bucket).

  Returns `(union [Bk, U], union_valid [Bk, U], local [Bk, O, N])` where
  `local` indexes `union`.
  """
  used = [np.unique(index[b][mask[b]]) for b in range(len(index))]
  size = max(multiple, -(-max(len(u) for u in used) // multiple) * multiple)
  union = np.zeros((len(index), size), np.int32)
  union_valid = np.zeros((len(index), size), bool)
  local = np.zeros(index.shape, np.int32)
  for b, u in enumerate(used):
    union[b, :len(u)] = u
    union_valid[b, :len(u)] = True
    if len(u):
      local[b] = np.minimum(np.searchsorted(u, index[b]), len(u) - 1)
  return union, union_valid, local


def _rho_on_union(vectors, union, local, index, mask, s_ctx, s_new, s_old,
                  e_ctx, e_new, e_old, *, lam: float, min_memories: int):
  """Anchored residuals with Gram blocks gathered from the union's Gram."""
  bk, o, d = e_new.shape
  n = index.shape[-1]
  union_vectors = _gather_rows(vectors, union)  # [Bk, U, d]
  maskf = mask.astype(jnp.float32)
  gram = _gather_pairs(jnp.einsum("bud,bvd->buv", union_vectors,
                                  union_vectors, precision=_HIGHEST), local)
  gram = gram * maskf[..., :, None] * maskf[..., None, :]
  per_op = jnp.stack([jnp.broadcast_to(s_ctx[:, None], s_new.shape), s_new,
                      s_old], axis=2)  # [Bk, O, 3, M]
  alignment = jnp.take_along_axis(per_op, index[..., None, :], axis=3)
  alignment = alignment * maskf[..., None, :]
  op_queries = jnp.stack([jnp.broadcast_to(e_ctx[:, None], e_new.shape),
                          e_new, e_old], axis=2)  # [Bk, O, 3, d]
  anchors = choose_anchors(alignment, jnp.diagonal(gram, axis1=-2, axis2=-1),
                           maskf)  # [Bk, O, 3]
  anchor_rows = _gather_rows(union_vectors, jnp.take_along_axis(
      local, anchors.index, axis=-1))  # [Bk, O, 3, d]
  # Exact difference when a query repeats a memory (see kernel module).
  shifted = (op_queries - anchors.sign[..., None] * anchor_rows).reshape(
      bk, o * 3, d)
  # rhs and residual through union-level GEMMs instead of gathering every
  # set's rows: M_op·s = (V_u·s)[local], M_opᵀw = (scatter w)ᵀ V_u.
  rhs = jnp.take_along_axis(
      jnp.einsum("bqd,bud->bqu", shifted, union_vectors,
                 precision=_HIGHEST).reshape(bk, o, 3, -1),
      local[..., None, :], axis=-1)  # [Bk, O, 3, N]
  rhs = jnp.swapaxes(rhs * maskf[..., None, :], -1, -2)  # [Bk, O, N, 3]
  corrections = solve_corrections(
      gram + lam * jnp.eye(n, dtype=jnp.float32), rhs, anchors, lam)
  scattered = jnp.zeros((bk, o, 3, union.shape[1]), jnp.float32)
  scattered = scattered.at[
      jnp.arange(bk)[:, None, None, None], jnp.arange(o)[None, :, None, None],
      jnp.arange(3)[None, None, :, None], local[:, :, None, :]].add(
          jnp.swapaxes(corrections, -1, -2) * maskf[..., None, :])
  res = (shifted - jnp.einsum("bqu,bud->bqd",
                              scattered.reshape(bk, o * 3, -1), union_vectors,
                              precision=_HIGHEST)).reshape(bk * o, 3, d)
  r_c, r_new, r_old = res[:, 0], res[:, 1], res[:, 2]
  sq_c = jnp.sum(r_c * r_c, -1)
  rho_new = partial_correlation(jnp.sum(r_c * r_new, -1), sq_c,
                                jnp.sum(r_new * r_new, -1)).reshape(bk, o)
  rho_old = partial_correlation(jnp.sum(r_c * r_old, -1), sq_c,
                                jnp.sum(r_old * r_old, -1)).reshape(bk, o)
  too_few = jnp.sum(mask, axis=-1) < min_memories  # [Bk, O]
  cos_new = jnp.sum(e_ctx[:, None] * e_new, -1)
  cos_old = jnp.sum(e_ctx[:, None] * e_old, -1)
  return (jnp.clip(jnp.where(too_few, cos_new, rho_new), -1, 1),
          jnp.clip(jnp.where(too_few, cos_old, rho_old), -1, 1))


_normalize_jit = jax.jit(_normalize_all)


@functools.lru_cache(maxsize=64)
def _per_bank_program(fn, mesh: jax.sharding.Mesh | None, axis: str | None,
                      **static):
  """`fn` jitted; with banks sharded over a mesh axis, run per device under
  `shard_map` (banks are independent: no collective is ever needed, where
  XLA's partitioner would gather top-k and scatter inputs across devices)."""
  body = functools.partial(fn, **static)
  if mesh is not None:
    body = jax.shard_map(body, mesh=mesh, in_specs=PartitionSpec(axis),
                         out_specs=PartitionSpec(axis), check_vma=False)
  return jax.jit(body)


def _bank_axis(array: jax.Array) -> tuple[jax.sharding.Mesh | None,
                                           str | None]:
  sharding = getattr(array, "sharding", None)
  if (isinstance(sharding, NamedSharding) and sharding.spec
      and isinstance(sharding.spec[0], str) and sharding.mesh.size > 1):
    return sharding.mesh, sharding.spec[0]
  return None, None


def _like(host: np.ndarray, reference: jax.Array) -> jax.Array:
  """Places a host array split over banks the way `reference` is."""
  sharding = reference.sharding
  if isinstance(sharding, NamedSharding) and sharding.spec:
    sharding = NamedSharding(sharding.mesh, PartitionSpec(sharding.spec[0]))
    return jax.device_put(host, sharding)
  return jnp.asarray(host)


def banked_rho(bank_vectors: jax.Array | np.ndarray,
               entry_valid: jax.Array | np.ndarray,
               recent: jax.Array | np.ndarray,
               e_ctx: jax.Array | np.ndarray, e_new: jax.Array | np.ndarray,
               e_old: jax.Array | np.ndarray, has_old: jax.Array | np.ndarray,
               lam: float = 1e-4,
               config: ConditioningConfig = ConditioningConfig(),
               min_memories: int = 2):
  """`rho(e_C, e_new | M_local)` and `rho(e_C, e_old | M_local)` per operation.

  Args:
    bank_vectors: `[Bk, M, d]` entry embeddings of each bank `M_{t-1}`
      (padded; any scale).
    entry_valid: `[Bk, M]` bool.
    recent: `[Bk, R]` positions of the newest episodic entries, -1 if none.
    e_ctx: `[Bk, d]` session embedding per bank.
    e_new: `[Bk, O, d]` fragment embeddings (padding rows allowed).
    e_old: `[Bk, O, d]` replaced-text embeddings (anything where not
      has_old; rho_old is then meaningless).
    has_old: `[Bk, O]` bool: REPLACE/UPDATE (old text enters the query).
    lam: λ.
    config: Conditioning-set sizes and weights.
    min_memories: Cosine fallback below this many conditioning memories.

  Returns:
    `(rho_new [Bk, O], rho_old [Bk, O], index [Bk, O, N], mask [Bk, O, N])`.

  Raises:
    ValueError: for NaN/inf embeddings.
  """
  check_finite(bank_vectors=bank_vectors, e_ctx=e_ctx, e_new=e_new, e_old=e_old)
  entry_valid = jnp.asarray(entry_valid, bool)
  vectors, ctx, new, old = _normalize_jit(
      jnp.asarray(bank_vectors, jnp.float32), entry_valid,
      jnp.asarray(e_ctx, jnp.float32), jnp.asarray(e_new, jnp.float32),
      jnp.asarray(e_old, jnp.float32))
  mesh, axis = _bank_axis(vectors)
  s_ctx, s_new, s_old, index, mask = _per_bank_program(
      _select, mesh, axis, config=config)(
          vectors, entry_valid, _like(np.asarray(recent, np.int32), vectors),
          ctx, new, old, jnp.asarray(has_old, bool))
  # The sets of a bank overlap (shared e_C and recent entries): the Gram of
  # their union is a fraction of the full bank Gram. Its size is data
  # dependent, so it is taken on the host and bucketed.
  union, _, local = _union(np.asarray(index), np.asarray(mask))
  rho_new, rho_old = _per_bank_program(
      _rho_on_union, mesh, axis, lam=float(lam), min_memories=min_memories)(
          vectors, _like(union, index), _like(local, index), index, mask,
          s_ctx, s_new, s_old, ctx, new, old)
  return rho_new, rho_old, index, mask
