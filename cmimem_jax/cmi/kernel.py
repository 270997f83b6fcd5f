"""Residual-projection CMI kernel (paper Eq. 7-9, §3.3; SPEC §4.1).

For each row, with unit-norm context `e_C`, fragment `e_new` and local
memories `M` (`[N, d]`, masked rows zero):

    G = M Mᵀ + λ I                      (N x N, SPD; Cholesky)
    r = e - Mᵀ G⁻¹ M e                  (the d x d projector is never formed)
    rho = r_C · r_new / (|r_C| |r_new|)

Everything the residuals' dot products need is in the Gram of the N + 2
stacked rows `[M; e_C; e_new]`: with `u = M e`, `w = G⁻¹ u`,

    r_a · r_b = e_a · e_b − u_a · w_b − λ w_a · w_b,

so the kernel never forms a d-dimensional residual. On CPU, past small
work, the Gram is one elementwise multiply-and-reduce with partial sums
per pair over strided lanes, or over blocks of 64 elements from N = 16
(`lane_products`; XLA:CPU runs batched small matmuls at a few GFLOP/s;
this form is 3-6x faster, and pairwise-summed), and
normalisation happens in N-space (`1/|x|` from the Gram's diagonal): no
normalised copy of the memories is ever written.

Numerics. A fragment that is (nearly) stored already has a residual of
size ~λ; the formula above would cancel O(1) terms down to it and lose
float32 accuracy. The solve is therefore anchored at the memory `m_j` most
aligned with `e` (sign `s`): with `δ = ê − s·m̂_j`, `v = M̂ δ`,
`G w = v − λ s·onehot(j)`,

    r_a · r_b = δ_a · δ_b − v_a · w_b − λ w_a · z_b − λ w_a · w_b,

the same value for any anchor, with every anchored quantity taken from the
Gram as a difference of entries. Every pair of rows is reduced by the same
code, so a fragment equal to a stored memory gives bitwise-equal Gram rows
and `δ`, `v` of exactly zero: its tiny residual keeps float32 accuracy.
Only the anchored rows need the second d-space pass (`M δ`, `δ·δ`): an
unanchored query's δ is e itself, whose products the first pass made.
Inputs whose squares would overflow or underflow float32 (|x| beyond about
1e18, or below 1e-19) are detected on the Gram's diagonal and recomputed
from normalised rows.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np

from cmimem_jax.models.attention import target_platform

# Below this residual norm rho is defined as 0 (SPEC §4.1 step 3).
RESIDUAL_NORM_FLOOR = 1e-6
# Vectors with a norm below this are treated as zero.
NORM_EPS = 1e-12


def l2_normalize(x: jax.Array) -> jax.Array:
  """Unit-norm rows (last axis); zero rows stay zero, gradients stay finite."""
  x = x.astype(jnp.float32)
  sum_sq = jnp.sum(x * x, axis=-1, keepdims=True)
  return x * jax.lax.rsqrt(jnp.maximum(sum_sq, NORM_EPS * NORM_EPS))


@dataclasses.dataclass(frozen=True)
class Anchors:
  """Per query: the memory the solve is anchored at (see module doc).

  Attributes:
    index: `[B, K]` memory position j.
    sign: `[B, K]` ±1, or 0 for no shift (masked, zero or orthogonal
      anchor). The anchor vector is `z = sign·onehot(index)`.
  """
  index: jax.Array
  sign: jax.Array


def choose_anchors(alignment: jax.Array, gram_diagonal: jax.Array,
                   mask: jax.Array) -> Anchors:
  """Anchors each unit query at its most aligned valid unit memory.

  Args:
    alignment: `[..., K, N]` cosines `ê·m̂`.
    gram_diagonal: `[..., N]` `|m̂|²` (+ λ): about 1 for real memories.
    mask: `[..., N]` float {0, 1}.
  """
  index = jnp.argmax(jnp.abs(alignment * mask[..., None, :]), axis=-1)
  value = jnp.take_along_axis(alignment, index[..., None], -1)[..., 0]
  usable = ((jnp.take_along_axis(mask, index, axis=-1) > 0)
            & (jnp.take_along_axis(gram_diagonal, index, axis=-1) > 0.5))
  return Anchors(index, jnp.where(usable, jnp.sign(value), 0.0))


def solve_corrections(gram: jax.Array, rhs: jax.Array, anchors: Anchors,
                      lam: jax.Array) -> jax.Array:
  """Solves `G w = rhs - λz` by Cholesky for every query.

  Args:
    gram: `[B, N, N]` normalised `M̂M̂ᵀ + λI` (masked rows: λ on the
      diagonal only).
    rhs: `[B, N, K]` `M̂ (ê - M̂ᵀz)`.
    anchors: From `choose_anchors`.
    lam: λ.

  Returns:
    `w` `[B, N, K]`.
  """
  n = gram.shape[-1]
  z = anchors.sign[..., None] * jax.nn.one_hot(anchors.index, n,
                                                dtype=jnp.float32)
  return spd_solve(gram, rhs - lam * jnp.swapaxes(z, -1, -2))


def spd_solve(gram: jax.Array, rhs: jax.Array) -> jax.Array:
  """`gram⁻¹ rhs` for SPD `[..., N, N]` `gram` and `[..., N, K]` `rhs`
  (Cholesky: on CPU unrolled up to `UNROLL_MAX_N`, else the platform's)."""
  if gram.shape[-1] <= UNROLL_MAX_N and target_platform() == "cpu":
    return _unrolled_cholesky_solve(gram, rhs)
  return jsl.cho_solve((jnp.linalg.cholesky(gram), True), rhs)


# Up to this N the factorisation is unrolled into [B]-vector ops: faster
# on CPU than per-matrix LAPACK calls (3x at N = 20), and free of LAPACK
# custom calls, which were seen to hang when several XLA CPU devices run
# them concurrently. Compile time grows as N^3 (about 5 s at N = 20).
UNROLL_MAX_N = 24


def _unrolled_cholesky_solve(gram: jax.Array, rhs: jax.Array) -> jax.Array:
  """`gram⁻¹ rhs` for `[..., N, N]` SPD `gram` and `[..., N, K]` `rhs`.

  Fully unrolled over the matrix entries: every entry of L, of the forward
  and of the back substitution is a `[...]` batch vector, so XLA fuses the
  whole solve into a few loops over the batch with the N x N factor in
  registers (15x faster than column-vector steps at N = 20).
  """
  n, k = gram.shape[-1], rhs.shape[-1]
  factor: list[list[jax.Array | None]] = [[None] * n for _ in range(n)]
  for j in range(n):
    diagonal = gram[..., j, j]
    for p in range(j):
      diagonal = diagonal - factor[j][p] * factor[j][p]
    inverse = jax.lax.rsqrt(diagonal)
    factor[j][j] = diagonal * inverse
    for i in range(j + 1, n):
      entry = gram[..., i, j]
      for p in range(j):
        entry = entry - factor[i][p] * factor[j][p]
      factor[i][j] = entry * inverse
  columns = []
  for c in range(k):
    forward: list[jax.Array | None] = [None] * n  # L y = rhs.
    for i in range(n):
      value = rhs[..., i, c]
      for p in range(i):
        value = value - factor[i][p] * forward[p]
      forward[i] = value / factor[i][i]
    solution: list[jax.Array | None] = [None] * n  # Lᵀ x = y.
    for i in reversed(range(n)):
      value = forward[i]
      for p in range(i + 1, n):
        value = value - factor[p][i] * solution[p]
      solution[i] = value / factor[i][i]
    columns.append(jnp.stack(solution, axis=-1))
  return jnp.stack(columns, axis=-1)


def partial_correlation(dot: jax.Array, sq_a: jax.Array, sq_b: jax.Array
                        ) -> jax.Array:
  """`dot / sqrt(sq_a sq_b)`, 0 where a norm is below the floor."""
  floor = RESIDUAL_NORM_FLOOR * RESIDUAL_NORM_FLOOR
  degenerate = (sq_a < floor) | (sq_b < floor)
  # Double-where keeps gradients finite on the guarded branch.
  denominator = jnp.sqrt(jnp.where(degenerate, 1.0, sq_a * sq_b))
  return jnp.where(degenerate, 0.0, dot / denominator)


GRAM_LANES = 8
# Elements per block of the blocked lane reduction: 17 % faster than 8
# blocks of d / 8 at d = 384 and 1024 (8 AVX2 vectors per block).
GRAM_BLOCK = 64
# A query at least this aligned with a stored memory is anchored at it.
ANCHOR_COSINE = 0.5
# Squared norms outside this range over- or underflowed float32.
_SQUARE_RANGE = (1e-30, 1e30)


def lane_products(a: jax.Array, b: jax.Array, blocked: bool = False
                  ) -> jax.Array:
  """`[B, R, d] x [B, S, d] -> [B, R, S]` dot products of every pair of
  rows, as one elementwise multiply-and-reduce keeping partial sums
  (XLA:CPU vectorises it over the lanes; as a batched matmul it runs
  the per-row products at a few GFLOP/s). Every pair goes through the same
  code: equal rows give bitwise-equal results.

  The partial sums are strided lanes (`x[k::GRAM_LANES]`), or with
  `blocked` contiguous blocks of `GRAM_BLOCK` elements, each reduced and
  materialised before the blocks' sums are added (XLA merges the lanes'
  two reductions into one, which is 3x slower on a Gram of 20 rows; the
  blocks are up to 1.5x slower on the K = 2 products and at N = 8)."""
  batch, dim = a.shape[0], a.shape[-1]
  width = GRAM_BLOCK if blocked else GRAM_LANES
  pad = (-dim) % width
  if pad:
    a = jnp.pad(a, ((0, 0), (0, 0), (0, pad)))
    b = jnp.pad(b, ((0, 0), (0, 0), (0, pad)))
  chunks = (dim + pad) // width  # Explicit: a side may have 0 rows.
  left = a.reshape(batch, a.shape[1], chunks, width)
  right = b.reshape(batch, b.shape[1], chunks, width)
  products = left[:, :, None] * right[:, None]
  # Fused with its consumers, XLA repeats the reduction (3-5x slower);
  # callers materialise computed operands for the same reason.
  if blocked:
    partial = jax.lax.optimization_barrier(jnp.sum(products, axis=-1))
    return jax.lax.optimization_barrier(jnp.sum(partial, axis=-1))
  return jax.lax.optimization_barrier(jnp.sum(products, axis=3).sum(-1))


def _power_of_two(x: jax.Array) -> jax.Array:
  """The power of two nearest `x` > 0 in log scale (multiplying by it is
  exact)."""
  _, exponent = jnp.frexp(x * np.float32(np.sqrt(2.0) / 2.0))
  return jnp.ldexp(jnp.ones_like(x), exponent)


@dataclasses.dataclass(frozen=True)
class _Products:
  """Stage 1: every d-space product the kernel needs of the raw rows."""
  qq: jax.Array         # [B, 2, 2] e_a·e_b
  gram: jax.Array       # [B, N, N] m_n·m_m
  alignment: jax.Array  # [B, 2, N] e_a·m_n


@dataclasses.dataclass(frozen=True)
class _Anchored:
  """Stage 2: the anchors z = c·onehot(j) of the queries."""
  scale: jax.Array      # [B, 2] c (0: not anchored)
  index: jax.Array      # [B, 2] j
  valid: jax.Array      # [B, N] usable memory (in the mask, non-zero)


jax.tree_util.register_dataclass(_Products, ["qq", "gram", "alignment"], [])
jax.tree_util.register_dataclass(_Anchored, ["scale", "index", "valid"], [])


# Up to this many memory elements (B·N·d) a batched matmul is faster than
# the lane reduction, and one fused program beats separate ones.
SMALL_WORK = 1 << 21
# From this many memories per row the lane reductions are blocked.
BLOCKED_MIN_N = 16


def _form(mem: jax.Array) -> str:
  """The form of every product of a call: "matmul" (small work or not
  CPU), or `lane_products` as "lanes" or "blocks" (N from
  `BLOCKED_MIN_N`). Decided per call, not per product: one batched matmul
  among lane reductions in a program slows it by more than the matmul
  takes alone (the [B, 2, 2] query products: +0.7 ms at B = 1024, N = 8,
  d = 384, a sixth of the call), and the anchored solve of a repeated
  memory needs the Gram and `M δ` summed in the same order (mixed, the
  error of a thrice-stored memory's rho grew from 2e-4 to 2e-3)."""
  batch, n, dim = mem.shape
  if target_platform() != "cpu" or batch * max(n, 2) * dim <= SMALL_WORK:
    return "matmul"
  return "blocks" if n >= BLOCKED_MIN_N else "lanes"


def _pairwise(a: jax.Array, b: jax.Array, form: str) -> jax.Array:
  """Dot products of every pair of rows, `[B, R, d] x [B, S, d] ->
  [B, R, S]` in `form` (see `_form`)."""
  if form != "matmul":
    return lane_products(a, b, blocked=form == "blocks")
  # CPU dots are float32 at any precision setting and "default" picks the
  # faster contraction; TPU / GPU need HIGHEST for float32 (not one bf16
  # pass) on their matrix units.
  on_cpu = target_platform() == "cpu"
  return jnp.einsum("brd,bsd->brs", a, b,
                    precision=None if on_cpu else jax.lax.Precision.HIGHEST)


def _products(queries: jax.Array, mem: jax.Array, form: str) -> _Products:
  # The memories stay the left operand of every product with the queries
  # (a [B, N, d] x [B, 2, d] contraction is 2x faster that way round).
  return _Products(_pairwise(queries, queries, form),
                   _pairwise(mem, mem, form),
                   jnp.swapaxes(_pairwise(mem, queries, form), -1, -2))


def _inverse_norms(squares: jax.Array, valid: jax.Array) -> jax.Array:
  """`1/sqrt(squares)` where valid, else 0 (finite gradients)."""
  return jnp.where(valid, jax.lax.rsqrt(jnp.where(valid, squares, 1.0)), 0.0)


def _anchor(mask: jax.Array, products: _Products) -> _Anchored:
  """Anchors each query at its most aligned memory when the cosine is at
  least `ANCHOR_COSINE`: z = c·onehot(j) with c = ±(the power of two
  nearest |e|/|m_j|), so c·m_j is exact and δ = e − c·m_j an exact
  difference when e ≈ c·m_j."""
  q_sq = jnp.diagonal(products.qq, axis1=-2, axis2=-1)
  m_sq = jnp.diagonal(products.gram, axis1=-2, axis2=-1)
  valid = mask.astype(bool) & (m_sq > 0)
  cosines = (products.alignment * _inverse_norms(q_sq, q_sq > 0)[..., :, None]
             * _inverse_norms(m_sq, valid)[..., None, :])
  anchors = choose_anchors(cosines, jnp.where(valid, 1.0, 0.0),
                           valid.astype(jnp.float32))
  best = jnp.take_along_axis(cosines, anchors.index[..., None], -1)[..., 0]
  anchor_sq = jnp.take_along_axis(m_sq, anchors.index, axis=-1)
  ratio = jnp.sqrt(q_sq / jnp.where(anchor_sq > 0, anchor_sq, 1.0))
  scale = jnp.where((jnp.abs(best) >= ANCHOR_COSINE) & (anchors.sign != 0),
                    anchors.sign * _power_of_two(jnp.maximum(ratio, 1e-30)),
                    0.0)
  return _Anchored(scale, anchors.index, valid)


def _deltas(queries: jax.Array, mem: jax.Array, scale: jax.Array,
            index: jax.Array) -> jax.Array:
  """The anchored queries δ = e − c·m_j `[B, 2, d]` (e itself where
  c = 0)."""
  anchor_rows = jnp.take_along_axis(mem, index[..., None], axis=1)
  return queries - scale[..., None] * anchor_rows


def _anchored_products(mem: jax.Array, deltas: jax.Array, form: str
                       ) -> tuple[jax.Array, jax.Array]:
  """Stage 3: `M δ` `[B, N, 2]` and `δ_a·δ_b` `[B, 2, 2]`."""
  return _pairwise(mem, deltas, form), _pairwise(deltas, deltas, form)


def _finish(products: _Products, anchored: _Anchored, v: jax.Array,
            dd: jax.Array, mask: jax.Array, lam: jax.Array,
            min_memories: jax.Array | int) -> jax.Array:
  """Stage 4 (N-space): the solve and `rho` `[B]`."""
  n = products.gram.shape[-1]
  valid = anchored.valid
  q_sq = jnp.diagonal(products.qq, axis1=-2, axis2=-1)
  q_inverse = _inverse_norms(q_sq, q_sq > 0)
  cosine = products.qq[..., 0, 1] * q_inverse[..., 0] * q_inverse[..., 1]
  pair = valid[..., :, None] & valid[..., None, :]
  gram = jnp.where(pair, products.gram, 0.0)
  # P = Mᵀ (S + λ diag|m|²)⁻¹ M: the normalised memories' projector.
  regular = jnp.where(valid, lam * jnp.diagonal(gram, axis1=-2, axis2=-1),
                      0.0)                                  # Λ: [B, N]
  solve_matrix = gram + jnp.eye(n, dtype=jnp.float32) * jnp.where(
      valid, regular, 1.0)[..., None, :]
  v = jnp.where(valid[..., None], v, 0.0)
  z = anchored.scale[..., None] * jax.nn.one_hot(anchored.index, n,
                                                  dtype=jnp.float32)
  w = spd_solve(solve_matrix,
                v - regular[..., :, None] * jnp.swapaxes(z, -1, -2))
  w = jnp.where(valid[..., None], w, 0.0)
  # r_a·r_b = δ_a·δ_b − v_a·w_b − w_aᵀ Λ (z_b + w_b).
  dots = (dd - jnp.einsum("bna,bnc->bac", v, w)
          - jnp.einsum("bna,bn,bcn->bac", w, regular,
                       z + jnp.swapaxes(w, -1, -2)))
  # rho is scale-free; the 1e-6 floor is on unit queries' residuals.
  floor = RESIDUAL_NORM_FLOOR * RESIDUAL_NORM_FLOOR
  degenerate = (dots[..., 0, 0] <= floor * q_sq[..., 0]) | (
      dots[..., 1, 1] <= floor * q_sq[..., 1])
  denominator = jnp.sqrt(jnp.where(degenerate, 1.0,
                                   dots[..., 0, 0] * dots[..., 1, 1]))
  rho = jnp.where(degenerate, 0.0, dots[..., 0, 1] / denominator)
  too_few = jnp.sum(mask.astype(jnp.int32), axis=-1) < min_memories
  return jnp.clip(jnp.where(too_few, cosine, rho), -1.0, 1.0)


def _row_squares(products: _Products) -> jax.Array:
  """`[B, 2 + N]` squared norms of the queries and of every memory."""
  return jnp.concatenate([jnp.diagonal(products.qq, axis1=-2, axis2=-1),
                          jnp.diagonal(products.gram, axis1=-2, axis2=-1)],
                         -1)


def _extreme(products: _Products, mask: jax.Array) -> jax.Array:
  """Whether a valid row's square over- or underflowed float32 (or is
  non-finite: then an input is, which `residual_cmi` reports)."""
  valid = jnp.concatenate([jnp.ones(mask.shape[:-1] + (2,), bool),
                           mask.astype(bool)], -1)
  squares = _row_squares(products)
  low, high = _SQUARE_RANGE
  out_of_range = ~(squares <= high) | ((squares > 0) & (squares < low))
  return jnp.any((valid & out_of_range) | ~jnp.isfinite(squares))


def _no_memories(products: _Products) -> jax.Array:
  q_sq = jnp.diagonal(products.qq, axis1=-2, axis2=-1)
  q_inverse = _inverse_norms(q_sq, q_sq > 0)
  return jnp.clip(products.qq[..., 0, 1] * q_inverse[..., 0]
                  * q_inverse[..., 1], -1.0, 1.0)


def _rho_raw(queries: jax.Array, mem: jax.Array, mask: jax.Array,
             lam: jax.Array, min_memories: jax.Array | int, form: str,
             products: _Products | None = None) -> jax.Array:
  """`rho` `[B]` of raw queries `[B, 2, d]` given raw memories
  `[B, N, d]`, the four stages in one trace with products in `form`;
  squares must not over- or underflow float32."""
  if products is None:
    products = _products(queries, mem, form)
  if mem.shape[1] == 0:
    return _no_memories(products)
  anchored = _anchor(mask, products)
  v, dd = _anchored_products(
      mem, _deltas(queries, mem, anchored.scale, anchored.index), form)
  return _finish(products, anchored, v, dd, mask, lam, min_memories)


def _queries(e_ctx: jax.Array, e_new: jax.Array) -> jax.Array:
  return jnp.stack([e_ctx, e_new], axis=1).astype(jnp.float32)


def residual_cmi_unchecked(e_ctx: jax.Array, e_new: jax.Array,
                           mem: jax.Array, mem_mask: jax.Array,
                           lam: jax.Array | float = 1e-4,
                           min_memories: jax.Array | int = 2) -> jax.Array:
  """The traceable core of `residual_cmi` (no input validation), for use
  inside `jit` / `grad` / `vmap` with inputs known finite. Shapes as in
  `residual_cmi`. (Traced into one program, XLA:CPU fuses the lane
  reductions of large batches with their consumers and runs them several
  times slower than `residual_cmi`'s separate programs; the values are the
  same.)"""
  lam = jnp.asarray(lam, jnp.float32)
  queries, mem = _queries(e_ctx, e_new), mem.astype(jnp.float32)
  form = _form(mem)
  products = _products(queries, mem, form)
  # Squares that over- or underflow: the same on normalised rows (rare).
  return jax.lax.cond(
      _extreme(products, mem_mask),
      lambda: _rho_raw(l2_normalize(queries), l2_normalize(mem), mem_mask,
                       lam, min_memories, form),
      lambda: _rho_raw(queries, mem, mem_mask, lam, min_memories, form,
                       products))


@jax.jit
def _small_program(e_ctx: jax.Array, e_new: jax.Array, mem: jax.Array,
                   mask: jax.Array, lam: jax.Array, min_memories: jax.Array
                   ) -> tuple[jax.Array, jax.Array]:
  """Small work in one program: `rho` and whether a row was extreme."""
  queries = _queries(e_ctx, e_new)
  products = _products(queries, mem, "matmul")
  return (_rho_raw(queries, mem, mask, lam, min_memories, "matmul",
                   products),
          _extreme(products, mask))


_products_jit = jax.jit(lambda e_ctx, e_new, mem, form: _products(
    _queries(e_ctx, e_new), mem, form), static_argnums=3)
_extreme_jit = jax.jit(_extreme)
_anchor_jit = jax.jit(_anchor)
_any_anchor_jit = jax.jit(lambda anchored: jnp.any(anchored.scale != 0, -1))
_deltas_jit = jax.jit(lambda e_ctx, e_new, mem, anchored: _deltas(
    _queries(e_ctx, e_new), mem, anchored.scale, anchored.index))
_finish_jit = jax.jit(_finish)
_no_memories_jit = jax.jit(_no_memories)
_normalize_jit = jax.jit(l2_normalize)


@jax.jit
def _anchored_rows(e_ctx: jax.Array, e_new: jax.Array, mem: jax.Array,
                   anchored: _Anchored, rows: jax.Array
                   ) -> tuple[jax.Array, jax.Array]:
  """The memories `[R, N, d]` and anchored queries δ `[R, 2, d]` of the
  given rows `[R]`, materialised (gathered inside the products' program,
  they slow its reduction 20x)."""
  mem = mem[rows]
  return mem, _deltas(_queries(e_ctx[rows], e_new[rows]), mem,
                      anchored.scale[rows], anchored.index[rows])


_anchored_products_jit = jax.jit(_anchored_products, static_argnums=2)


@jax.jit
def _unanchored_products(products: _Products
                         ) -> tuple[jax.Array, jax.Array]:
  """Stage 3 where no query is anchored (δ = e): stage 1's products."""
  return jnp.swapaxes(products.alignment, -1, -2), products.qq


@jax.jit
def _merge_anchored(products: _Products, rows: jax.Array, v: jax.Array,
                    dd: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`M δ` `[B, N, 2]` and `δ_a·δ_b` `[B, 2, 2]` of every row: an
  unanchored row's δ is e, whose products stage 1 has already computed;
  the given rows `[R]` take `v` `[R, N, 2]` and `dd` `[R, 2, 2]`."""
  unanchored_v, unanchored_dd = _unanchored_products(products)
  return unanchored_v.at[rows].set(v), unanchored_dd.at[rows].set(dd)


# The anchored pass gathers its rows while they are at most this fraction
# of the batch (padded) and on one device: XLA:CPU's gather of the
# memories costs about as much as the pass itself (at B = 8192, N = 20,
# d = 1024: +21 ms with an eighth of the rows anchored, +123 ms with half,
# +67 ms for all rows ungathered; over 2 devices +250 ms with a fifth).
ANCHORED_GATHER_MAX = 0.25


def _row_bucket(count: int, batch: int) -> int:
  """Rows of the anchored pass for `count` anchored rows: a power of two
  (few compiled shapes), at most `batch`."""
  return min(batch, max(8, 1 << (count - 1).bit_length()))


def _large_programs(e_ctx: jax.Array, e_new: jax.Array, mem: jax.Array,
                    mask: jax.Array, lam: jax.Array,
                    min_memories: jax.Array, form: str
                    ) -> tuple[jax.Array, jax.Array]:
  """Large work as separate programs: no lane reduction fused with an
  elementwise consumer (which slows XLA:CPU's reduction 3-5x). The
  d-space pass of stage 3 runs over the anchored rows only (gathered while
  few and on one device, else over the whole batch): an unanchored
  query's δ is e itself, so its products are stage 1's. Random vectors are never
  anchored; a stored or nearly stored fragment is."""
  products = _products_jit(e_ctx, e_new, mem, form)
  if mem.shape[1] == 0:
    return _no_memories_jit(products), _extreme_jit(products, mask)
  anchored = _anchor_jit(mask, products)
  rows = np.flatnonzero(np.asarray(_any_anchor_jit(anchored)))
  batch = mem.shape[0]
  bucket = _row_bucket(len(rows), batch)
  if not len(rows):
    v, dd = _unanchored_products(products)
  elif (bucket > batch * ANCHORED_GATHER_MAX
        or len(mem.sharding.device_set) > 1):  # A gather across devices.
    v, dd = _anchored_products_jit(
        mem, _deltas_jit(e_ctx, e_new, mem, anchored), form)
  else:
    # Padding repeats a row: the same values are written twice.
    padded = np.full(bucket, rows[0])
    padded[:len(rows)] = rows
    v, dd = _merge_anchored(products, padded, *_anchored_products_jit(
        *_anchored_rows(e_ctx, e_new, mem, anchored, padded), form))
  return (_finish_jit(products, anchored, v, dd, mask, lam, min_memories),
          _extreme_jit(products, mask))


@jax.jit
def _all_finite(x: jax.Array) -> jax.Array:
  return jnp.all(jnp.isfinite(x))


def check_finite(**arrays: jax.Array | np.ndarray) -> None:
  """Raises ValueError naming the first input with NaN/inf (eager only)."""
  for name, value in arrays.items():
    if isinstance(value, jax.core.Tracer):
      continue
    # Device arrays are checked where they live; only failures come back.
    if bool(_all_finite(value) if isinstance(value, jax.Array)
            else np.isfinite(value).all()):
      continue
    finite = np.isfinite(np.asarray(value))
    if not finite.all():
      rows = np.unique(np.nonzero(~finite)[0])
      raise ValueError(f"{name} has NaN/inf values in {len(rows)} row(s), "
                       f"first rows {rows[:5].tolist()}")


def _device_array(x: jax.Array | np.ndarray,
                  dtype: jnp.dtype | None = None) -> jax.Array:
  """`x` on the device; a device array of the right dtype as it is
  (`jnp.asarray` costs ~7 µs even then, a fifth of a small call)."""
  if isinstance(x, jax.Array) and (dtype is None or x.dtype == dtype):
    return x
  return jnp.asarray(x, dtype)


@functools.lru_cache(maxsize=64)
def _traced_scalars(lam: float, min_memories: int
                    ) -> tuple[jax.Array, jax.Array]:
  """λ and `min_memories` as device scalars, made once per value.

  Traced, not static, so a sweep over λ reuses one compiled program; and
  cached, since moving a host scalar to the device on every call costs
  ~10 µs each (creating a device scalar costs ~50 µs, as much as the
  whole small-batch program). Uncommitted, so they follow inputs placed
  on any device or sharded over several. Raises ValueError for λ <= 0.
  """
  _check_lam(lam)
  return (jax.device_put(np.float32(lam)),
          jax.device_put(np.int32(min_memories)))


def residual_cmi(e_ctx: jax.Array | np.ndarray, e_new: jax.Array | np.ndarray,
                 mem: jax.Array | np.ndarray,
                 mem_mask: jax.Array | np.ndarray,
                 lam: float = 1e-4, min_memories: int = 2) -> jax.Array:
  """Partial correlation of context and fragment given local memories.

  Args:
    e_ctx: `[B, d]` context (session) embeddings `e_C`.
    e_new: `[B, d]` candidate fragment embeddings `e_new`.
    mem: `[B, N, d]` local conditioning memories `M_{t-1}^local`.
    mem_mask: `[B, N]` bool, True for real memories (any mix of counts runs
      in one compiled program per shape).
    lam: Tikhonov regularisation λ (Table 7: 1e-4).
    min_memories: Rows with fewer valid memories fall back to
      `cos(e_C, e_new)` (§3.3).

  Returns:
    `rho` `[B]` float32 in [-1, 1]; 0 where a residual norm is below 1e-6.
    Inputs need not be normalised. Differentiable; jit-compiled; shards
    like its inputs (the batch axis is independent).

  Raises:
    ValueError: on inconsistent shapes, `lam <= 0`, or NaN/inf inputs
      (checked when called eagerly; inside a trace only shapes are checked).
  """
  if any(isinstance(x, jax.core.Tracer) for x in (e_ctx, e_new, mem,
                                                 mem_mask, lam)):
    _check_shapes(np.shape(e_ctx), np.shape(e_new), np.shape(mem),
                  np.shape(mem_mask))
    if isinstance(lam, (int, float)):
      _check_lam(lam)
    return residual_cmi_unchecked(e_ctx, e_new, mem, mem_mask, lam,
                                  min_memories)
  # The eager path does as little Python as it can: at B = 64 the
  # compiled program takes ~0.2 ms, and every 10 µs here is 5 %.
  _check_shapes(np.shape(e_ctx), np.shape(e_new), np.shape(mem),
                np.shape(mem_mask))
  lam_, min_ = _traced_scalars(float(lam), int(min_memories))
  e_ctx, e_new = _device_array(e_ctx), _device_array(e_new)
  mem, mem_mask = _device_array(mem, jnp.float32), _device_array(mem_mask)
  form = _form(mem)
  run = (_small_program if form == "matmul"
         else functools.partial(_large_programs, form=form))
  rho, extreme = run(e_ctx, e_new, mem, mem_mask, lam_, min_)
  # A non-finite input makes its row's square non-finite, hence extreme:
  # only then are the inputs themselves examined (one more pass).
  # (`np.asarray` fetches the flag in ~4 µs, `bool` of the array in ~20.)
  if np.asarray(extreme):
    check_finite(e_ctx=e_ctx, e_new=e_new, mem=mem)
    rho, _ = run(_normalize_jit(e_ctx), _normalize_jit(e_new),
                 _normalize_jit(mem), mem_mask, lam_, min_)
  return rho


@functools.lru_cache(maxsize=256)
def _check_shapes(e_ctx: tuple[int, ...], e_new: tuple[int, ...],
                  mem: tuple[int, ...], mem_mask: tuple[int, ...]) -> None:
  """Raises ValueError unless the shapes are `[B, d]`, `[B, d]`,
  `[B, N, d]`, `[B, N]` (cached: only new shapes are examined)."""
  if len(mem) != 3:
    raise ValueError(f"mem must be [B, N, d], got {mem}")
  batch, n, dim = mem
  expected = {"e_ctx": (batch, dim), "e_new": (batch, dim),
              "mem_mask": (batch, n)}
  given = {"e_ctx": e_ctx, "e_new": e_new, "mem_mask": mem_mask}
  for name, shape in expected.items():
    if given[name] != shape:
      raise ValueError(f"{name} must be {list(shape)} to match mem "
                       f"{list(mem)}, got {list(given[name])}")


def _check_lam(lam: float) -> None:
  if not lam > 0:
    raise ValueError(f"lam must be positive, got {lam}")
