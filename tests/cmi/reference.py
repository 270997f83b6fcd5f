"""Float64 NumPy implementation of SPEC §4.1, written from the equations."""

import numpy as np


def _unit(v: np.ndarray) -> np.ndarray:
  norm = np.linalg.norm(v)
  return v / norm if norm > 1e-12 else np.zeros_like(v)


def residual_cmi_reference(e_ctx, e_new, mem, mem_mask, lam=1e-4,
                           min_memories=2) -> np.ndarray:
  out = []
  for b in range(len(e_ctx)):
    c = _unit(np.asarray(e_ctx[b], np.float64))
    n = _unit(np.asarray(e_new[b], np.float64))
    rows = [_unit(np.asarray(m, np.float64)) * bool(keep)
            for m, keep in zip(mem[b], mem_mask[b])]
    if int(np.sum(mem_mask[b])) < min_memories:
      out.append(c @ n)
      continue
    m = np.stack(rows)
    projector = m.T @ np.linalg.inv(m @ m.T + lam * np.eye(len(m))) @ m
    r_c, r_n = c - projector @ c, n - projector @ n
    if np.linalg.norm(r_c) < 1e-6 or np.linalg.norm(r_n) < 1e-6:
      out.append(0.0)
      continue
    out.append(r_c @ r_n / (np.linalg.norm(r_c) * np.linalg.norm(r_n)))
  return np.clip(np.array(out), -1, 1)
