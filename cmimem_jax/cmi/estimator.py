"""The CMI estimate of memory operations on their banks (paper §3.3, Eq. 9,
App. F; SPEC §4.2): ρ(new) and ρ(old) of each operation's texts given the
session `C_t` and a local conditioning set drawn from its bank `M_{t-1}`.

What the estimate is used for (Eq. 10's routing, Eq. 11's shaping, the
reward) is the task's (`task.reward`); this module only estimates. Items
sharing one bank object (the rollouts of one session) are scored together
against it, and every bank of a batch goes through one `banked_rho` call.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np

from cmimem_jax.cmi.banked import banked_rho
from cmimem_jax.cmi.conditioning import ConditioningConfig
from cmimem_jax.memory.bank import ConditioningPool, MemoryBank

# "residual": ρ on the local conditioning set (§3.3, the method);
# "cosine": unconditional cos(e_C, e_new) (Table 9 "w. emb", our reading).
KINDS = ("residual", "cosine")


@dataclasses.dataclass(frozen=True)
class OperationTexts:
  """The texts of one operation the CMI scores.

  Attributes:
    new: What it writes (`e_new`).
    old: What it replaces (`e_old`), None for an addition.
    old_in_query: Whether `e_old` joins the retrieval query (Eq. 17: the
      updates of an entry or a core line).
  """
  new: str
  old: str | None = None
  old_in_query: bool = False


@dataclasses.dataclass(frozen=True)
class BankOperations:
  """Operations on one bank: `M_{t-1}`, the session text `C_t`, and what
  each operation writes / replaces. Items with the same `bank` object are
  conditioned on it together (one `C_t`: the first item's)."""
  bank: MemoryBank
  context: str
  operations: Sequence[OperationTexts]


def _bucket(size: int, multiple: int) -> int:
  return max(multiple, int(math.ceil(size / multiple)) * multiple)


def _cosines(context: np.ndarray, texts: np.ndarray) -> np.ndarray:
  """`[Bk, O]` cos(e_C, e_text) of `[Bk, d]` contexts and `[Bk, O, d]` texts
  (zero rows give 0)."""
  unit = lambda x: x / np.maximum(  # noqa: E731
      np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)
  return np.einsum("bd,bod->bo", unit(context), unit(texts))


def pool_arrays(pool: ConditioningPool, embeddings: Mapping[str, np.ndarray],
                dim: int) -> tuple[np.ndarray, np.ndarray]:
  """The conditioning pool as `banked_rho` takes it: `[M, d]` entry vectors
  then the core lines' (from `embeddings`), and the newest episodic rows."""
  core = (np.stack([embeddings[line] for line in pool.core_lines])
          if pool.core_lines else np.zeros((0, dim), np.float32))
  return (np.concatenate([pool.vectors, core.astype(np.float32)]),
          pool.episodic_newest)


class CMIEstimator:
  """ρ(new), ρ(old) of operations on their banks, batched.

  Args:
    dim: The encoder's embedding width.
    kind: One of `KINDS`.
    lam: The residual solve's ridge λ.
    conditioning: Conditioning-set sizes and query weights (App. F).
    min_memories: Below this many conditioning memories, ρ is the plain
      cosine (`banked_rho`).
  """

  def __init__(self, dim: int, kind: str = "residual", lam: float = 1e-4,
               conditioning: ConditioningConfig = ConditioningConfig(),
               min_memories: int = 2):
    if kind not in KINDS:
      raise ValueError(f"CMI estimator kind must be one of {KINDS}, got "
                       f"{kind!r}")
    self.dim, self.kind, self.lam = dim, kind, lam
    self.conditioning, self.min_memories = conditioning, min_memories

  @staticmethod
  def texts(items: Sequence[BankOperations]) -> set[str]:
    """Every text `rho` looks up in its `embeddings`: contexts, the banks'
    core lines and the operations' texts."""
    texts = set()
    for item in items:
      texts.add(item.context)
      texts.update(item.bank.core_lines())
      for op in item.operations:
        texts.update(t for t in (op.new, op.old) if t is not None)
    return texts

  def rho(self, items: Sequence[BankOperations],
          embeddings: Mapping[str, np.ndarray]
          ) -> list[list[tuple[float, float]]]:
    """`(ρ(new), ρ(old))` of each item's operations, in order (ρ(old) of
    an operation without `old` is that of a zero vector: not meaningful).

    Args:
      items: The operations, grouped by bank object.
      embeddings: `[d]` vectors of at least `texts(items)`.
    """
    groups: dict[int, list[int]] = collections.defaultdict(list)
    for i, item in enumerate(items):
      if item.operations:
        groups[id(item.bank)].append(i)
    results: list[list[tuple[float, float]]] = [[] for _ in items]
    if not groups:
      return results
    members = list(groups.values())
    pools = [pool_arrays(items[g[0]].bank.conditioning_pool(), embeddings,
                         self.dim) for g in members]
    m = _bucket(max(len(v) for v, _ in pools), 32)
    o = _bucket(max(sum(len(items[i].operations) for i in g)
                    for g in members), 16)
    n_recent = self.conditioning.n_recent
    vectors = np.zeros((len(members), m, self.dim), np.float32)
    valid = np.zeros((len(members), m), bool)
    recent = -np.ones((len(members), n_recent), np.int64)
    ctx = np.zeros((len(members), self.dim), np.float32)
    new = np.zeros((len(members), o, self.dim), np.float32)
    old = np.zeros((len(members), o, self.dim), np.float32)
    has_old = np.zeros((len(members), o), bool)
    for b, (group, (pool_vectors, newest)) in enumerate(zip(members, pools)):
      vectors[b, :len(pool_vectors)] = pool_vectors
      valid[b, :len(pool_vectors)] = True
      newest = newest[:n_recent]
      recent[b, :len(newest)] = newest
      ctx[b] = embeddings[items[group[0]].context]
      slot = 0
      for i in group:
        for op in items[i].operations:
          new[b, slot] = embeddings[op.new]
          if op.old is not None:
            old[b, slot] = embeddings[op.old]
            has_old[b, slot] = op.old_in_query
          slot += 1
    if self.kind == "cosine":
      rho_new, rho_old = _cosines(ctx, new), _cosines(ctx, old)
    else:
      rho_new, rho_old, _, _ = banked_rho(
          vectors, valid, recent, ctx, new, old, has_old, lam=self.lam,
          config=self.conditioning, min_memories=self.min_memories)
      rho_new, rho_old = np.asarray(rho_new), np.asarray(rho_old)
    for b, group in enumerate(members):
      slot = 0
      for i in group:
        for _ in items[i].operations:
          results[i].append((float(rho_new[b, slot]), float(rho_old[b, slot])))
          slot += 1
    return results
