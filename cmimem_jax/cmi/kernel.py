"""Residual-projection CMI kernel (paper Eq. 7-9, §3.3; SPEC §4.1).

For each row, with unit-norm context `e_C`, fragment `e_new` and local
memories `M` (`[N, d]`, masked rows zero):

    G = M Mᵀ + λ I                      (N x N, SPD; Cholesky)
    r = e - Mᵀ G⁻¹ M e                  (the d x d projector is never formed)
    rho = r_C · r_new / (|r_C| |r_new|)

Numerics. A fragment that is (nearly) stored already has a residual of size
~λ; computing `e - Mᵀx` directly cancels two O(1) vectors and leaves
float32 rounding of relative size eps/λ. The solve is therefore anchored at
the memory `m_j` most aligned with `e` (sign `s`): with `z = c·onehot(j)`
chosen so that `Mᵀz = s·m_j/|e|`,

    r = ê - Mᵀz - Mᵀw,   G w = M(ê - Mᵀz) - λ z,

which is the same residual for any `z`, but `e - s·m_j` is an exact float
difference (Sterbenz) when `e ≈ ±m_j`, so tiny residuals keep float32
accuracy. Normalisation is folded into N-space scales: no `[B, N, d]`
normalised copy of the memories is materialised.

The d-space statistics (`M Mᵀ`, `M e`) and the residual formation are split
from the N-space steps so that `cmi.workload` can supply the statistics from
bank-level GEMMs instead of per-row small matmuls.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np

# Below this residual norm rho is defined as 0 (SPEC §4.1 step 3).
RESIDUAL_NORM_FLOOR = 1e-6
# Vectors with a norm below this are treated as zero.
NORM_EPS = 1e-12
_HIGHEST = jax.lax.Precision.HIGHEST


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
  rhs = rhs - lam * jnp.swapaxes(z, -1, -2)
  if n <= UNROLL_MAX_N:
    return _unrolled_cholesky_solve(gram, rhs)
  return jsl.cho_solve((jnp.linalg.cholesky(gram), True), rhs)


# Up to this N the factorisation is unrolled into [B]-vector ops: 3-5x
# faster on CPU than per-matrix LAPACK calls at N ~ 10, and free of LAPACK
# custom calls, which were seen to hang when several XLA CPU devices run
# them concurrently. Compile time grows as N^2 (about 10 s at N = 20).
UNROLL_MAX_N = 24


def _unrolled_cholesky_solve(gram: jax.Array, rhs: jax.Array) -> jax.Array:
  """`gram⁻¹ rhs` for `[..., N, N]` SPD `gram` and `[..., N, K]` `rhs`.

  Column-oriented Cholesky: column j of L is a `[..., N]` vector, so each
  step is one vectorised op over the batch.
  """
  n = gram.shape[-1]
  rows = jnp.arange(n)
  columns: list[jax.Array] = []
  for j in range(n):
    v = gram[..., :, j]
    for k in range(j):
      v = v - columns[k] * columns[k][..., j:j + 1]
    columns.append(jnp.where(rows >= j, v * jax.lax.rsqrt(v[..., j:j + 1]),
                             0.0))
  forward: list[jax.Array] = []  # L y = rhs, eliminating column by column.
  remaining = rhs
  for k in range(n):
    y = remaining[..., k, :] / columns[k][..., k:k + 1]
    forward.append(y)
    remaining = remaining - columns[k][..., :, None] * y[..., None, :]
  solution: list[jax.Array | None] = [None] * n  # Lᵀ x = y.
  for i in reversed(range(n)):
    acc = forward[i]
    for k in range(i + 1, n):
      acc = acc - columns[i][..., k:k + 1] * solution[k]
    solution[i] = acc / columns[i][..., i:i + 1]
  return jnp.stack(solution, axis=-2)


def partial_correlation(dot: jax.Array, sq_a: jax.Array, sq_b: jax.Array
                        ) -> jax.Array:
  """`dot / sqrt(sq_a sq_b)`, 0 where a norm is below the floor."""
  floor = RESIDUAL_NORM_FLOOR * RESIDUAL_NORM_FLOOR
  degenerate = (sq_a < floor) | (sq_b < floor)
  # Double-where keeps gradients finite on the guarded branch.
  denominator = jnp.sqrt(jnp.where(degenerate, 1.0, sq_a * sq_b))
  return jnp.where(degenerate, 0.0, dot / denominator)


def normalize_inputs(queries: jax.Array, memories: jax.Array,
                     mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Unit queries `[B, K, d]` and unit, masked memories `[B, N, d]`.

  Both go through the same row reduction, so equal input rows give
  bitwise-equal unit rows when this runs as its own program (the anchored
  difference relies on it; see `residual_cmi_unchecked`). Normalising before
  any product keeps every finite input finite.
  """
  return (l2_normalize(queries),
          l2_normalize(memories) * mask.astype(jnp.float32)[..., None])


def normalized_residuals(queries: jax.Array, memories: jax.Array,
                         mask: jax.Array, lam: jax.Array | float,
                         gram: jax.Array | None = None,
                         alignment: jax.Array | None = None) -> jax.Array:
  """`(I - P) q` for unit queries `[B, K, d]` and unit masked memories.

  Args:
    queries: `[B, K, d]` from `normalize_inputs`.
    memories: `[B, N, d]` unit rows; masked rows may hold anything when
      `gram` and `alignment` are given (they must be masked), else zero.
    mask: `[B, N]` validity.
    lam: Tikhonov λ > 0.
    gram: Optional precomputed `M̂M̂ᵀ` `[B, N, N]` (without λ), e.g.
      gathered from a bank-level Gram (masked rows and columns zero).
    alignment: Optional precomputed `q·m̂` `[B, K, N]`.

  Returns:
    `[B, K, d]` residuals.
  """
  n = memories.shape[-2]
  if n == 0:
    return queries
  if gram is None:
    gram = jnp.einsum("bnd,bmd->bnm", memories, memories, precision=_HIGHEST)
  gram = gram + lam * jnp.eye(n, dtype=jnp.float32)
  if alignment is None:
    alignment = jnp.einsum("bkd,bnd->bkn", queries, memories,
                           precision=_HIGHEST)
  anchors = choose_anchors(alignment, jnp.diagonal(gram, axis1=-2, axis2=-1),
                           mask.astype(jnp.float32))
  anchor_rows = jnp.take_along_axis(memories, anchors.index[..., None], axis=1)
  # Exact difference when a query repeats a memory (Sterbenz).
  shifted = queries - anchors.sign[..., None] * anchor_rows
  # Masking rhs (not the memories) zeroes w on masked slots, so masked rows
  # never enter the residual even when they hold stale data.
  rhs = (jnp.einsum("bnd,bkd->bnk", memories, shifted, precision=_HIGHEST)
         * mask.astype(jnp.float32)[..., None])
  corrections = solve_corrections(gram, rhs, anchors, lam)
  return shifted - jnp.einsum("bnk,bnd->bkd", corrections, memories,
                              precision=_HIGHEST)


def rho_from_normalized(queries: jax.Array, memories: jax.Array,
                        mask: jax.Array, lam: jax.Array | float,
                        min_memories: jax.Array | int) -> jax.Array:
  """`rho` `[B]` for unit `(e_C, e_new)` queries `[B, 2, d]` (see
  `residual_cmi`)."""
  lam = jnp.asarray(lam, jnp.float32)
  res = normalized_residuals(queries, memories, mask, lam)
  r_c, r_new = res[:, 0], res[:, 1]
  rho = partial_correlation(jnp.sum(r_c * r_new, -1), jnp.sum(r_c * r_c, -1),
                            jnp.sum(r_new * r_new, -1))
  cosine = jnp.sum(queries[:, 0] * queries[:, 1], axis=-1)
  too_few = jnp.sum(mask.astype(jnp.int32), axis=-1) < min_memories
  return jnp.clip(jnp.where(too_few, cosine, rho), -1.0, 1.0)


def residual_cmi_unchecked(e_ctx: jax.Array, e_new: jax.Array,
                           mem: jax.Array, mem_mask: jax.Array,
                           lam: jax.Array | float = 1e-4,
                           min_memories: jax.Array | int = 2) -> jax.Array:
  """The traceable core of `residual_cmi` (no input validation).

  For use inside `jit`/`grad`/`vmap` with inputs known finite. Shapes as in
  `residual_cmi`. Inside a larger program XLA may fuse the normalisation
  into its consumers and round it differently per use, which costs the
  anchored solve its exactness when a fragment repeats a memory (errors up
  to ~1e-4 instead of ~1e-6 in that case); `residual_cmi` avoids this by
  normalising in a separate program.
  """
  queries, memories = normalize_inputs(jnp.stack([e_ctx, e_new], axis=1), mem,
                                       mem_mask)
  return rho_from_normalized(queries, memories, mem_mask, lam, min_memories)


_normalize_jit = jax.jit(normalize_inputs)
_rho_jit = jax.jit(rho_from_normalized)


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
  shapes = {"e_ctx": np.shape(e_ctx), "e_new": np.shape(e_new),
            "mem": np.shape(mem), "mem_mask": np.shape(mem_mask)}
  if len(shapes["mem"]) != 3:
    raise ValueError(f"mem must be [B, N, d], got {shapes['mem']}")
  batch, n, dim = shapes["mem"]
  expected = {"e_ctx": (batch, dim), "e_new": (batch, dim),
              "mem_mask": (batch, n)}
  for name, shape in expected.items():
    if shapes[name] != shape:
      raise ValueError(f"{name} must be {list(shape)} to match mem "
                       f"{list(shapes['mem'])}, got {list(shapes[name])}")
  if isinstance(lam, (int, float)) and not lam > 0:
    raise ValueError(f"lam must be positive, got {lam}")
  check_finite(e_ctx=e_ctx, e_new=e_new, mem=mem)
  # Two programs: the normalised rows must be materialised once so that
  # every later use sees the same bits (see `residual_cmi_unchecked`).
  queries, memories = _normalize_jit(jnp.stack([jnp.asarray(e_ctx),
                                                jnp.asarray(e_new)], axis=1),
                                     mem, mem_mask)
  return _rho_jit(queries, memories, mem_mask, lam, min_memories)
