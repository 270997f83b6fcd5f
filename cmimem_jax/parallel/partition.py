"""Partition rules: which mesh axes split each parameter, optimizer-state
leaf and activation.

Rules are `(regex, PartitionSpec)` pairs matched against a parameter's
dotted path (`layers.q_proj`); the first match wins and every parameter
must match one (an unmatched path is an error, not silent replication). A
dimension whose size the mesh axis does not divide is left unsplit, so one
rule set serves every model size and mesh shape.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from cmimem_jax.parallel.mesh import BATCH_AXES

Rules = Sequence[tuple[str, P]]

# Qwen3 / Llama (`models.qwen3`): stacked layers `[L, in, out]`; the
# contraction of attention and MLP happens over `tensor`-split heads and
# intermediate units, parameters are additionally split over `fsdp`. The
# vocabulary is split over both (a vocabulary-parallel LM head, with the
# `head_hidden` and `logits` activations below): no device gathers the
# whole `[V, H]` head or forms its whole gradient, as every device would
# with the hidden size split over `fsdp` instead (what that costs on a
# v5p-8: BENCHMARKS.md "Round four: a vocabulary-parallel LM head").
QWEN3_RULES: Rules = (
    (r"^embed$", P(("tensor", "fsdp"), None)),       # [V, H]
    (r"^lm_head$", P(None, ("tensor", "fsdp"))),     # [H, V]
    (r"^layers\.(q|k|v|gate|up)_proj$", P(None, "fsdp", "tensor")),
    (r"^layers\.(o|down)_proj$", P(None, "tensor", "fsdp")),
    (r"^layers\.(q|k|v)_bias$", P(None, "tensor")),
    (r"norm$", P()),                                 # All RMSNorm weights.
)

# Activations: batch over data × fsdp. The LM head's input rows
# (`head_hidden`) are gathered over fsdp and its logits keep the
# vocabulary split as the head's parameter is.
ACTIVATION_RULES: dict[str, P] = {
    "tokens": P(BATCH_AXES, None),          # [B, T]
    "hidden": P(BATCH_AXES, None, None),    # [B, T, H]
    "head_hidden": P("data", None, None),   # [B, T, H]
    "logits": P("data", None, ("tensor", "fsdp")),  # [B, T, V]
    "per_row": P(BATCH_AXES),               # [B]
}


def path_name(path: tuple[Any, ...]) -> str:
  """Dotted name of a pytree key path (`layers.q_proj`)."""
  parts = []
  for key in path:
    for attr in ("key", "name", "idx"):
      if hasattr(key, attr):
        parts.append(str(getattr(key, attr)))
        break
  return ".".join(parts)


def fit_spec(spec: P, shape: Sequence[int], mesh: Mesh) -> P:
  """Drops the axes of `spec` that do not divide their dimension."""
  dims = list(spec) + [None] * (len(shape) - len(spec))
  fitted = []
  for size, axes in zip(shape, dims):
    names = (axes,) if isinstance(axes, str) else tuple(axes or ())
    split = int(np.prod([mesh.shape[a] for a in names])) if names else 1
    fitted.append(axes if names and size % split == 0 else None)
  while fitted and fitted[-1] is None:  # Canonical: P() not P(None,).
    fitted.pop()
  return P(*fitted)


def spec_for(name: str, shape: Sequence[int], rules: Rules, mesh: Mesh) -> P:
  for pattern, spec in rules:
    if re.search(pattern, name):
      if len(spec) > len(shape):
        raise ValueError(f"rule {pattern!r} -> {spec} has more dims than "
                         f"{name} {tuple(shape)}")
      return fit_spec(spec, shape, mesh)
  raise ValueError(f"no partition rule matches parameter {name!r} "
                   f"{tuple(shape)}; add one to the rule set")


def param_shardings(params: Any, mesh: Mesh, rules: Rules = QWEN3_RULES
                    ) -> Any:
  """A pytree of `NamedSharding`s matching `params` (arrays or
  `ShapeDtypeStruct`s)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: NamedSharding(mesh, spec_for(path_name(path), x.shape,
                                                   rules, mesh)), params)


def optimizer_shardings(optimizer: optax.GradientTransformation,
                        abstract_params: Any, shardings: Any, mesh: Mesh
                        ) -> Any:
  """Shardings of `optimizer.init(params)`: moment leaves follow their
  parameter, everything else (step counts, scalars) is replicated."""
  state = jax.eval_shape(optimizer.init, abstract_params)
  replicated = NamedSharding(mesh, P())
  return optax.tree_map_params(
      optimizer, lambda _, sharding: sharding, state, shardings,
      transform_non_params=lambda _: replicated)


def activation_sharding(mesh: Mesh, kind: str, shape: Sequence[int]
                        ) -> NamedSharding:
  return NamedSharding(mesh, fit_spec(ACTIVATION_RULES[kind], shape, mesh))


def constrain(x: jax.Array, mesh: Mesh | None, kind: str) -> jax.Array:
  """`with_sharding_constraint` by activation kind (no-op without mesh)."""
  if mesh is None:
    return x
  return jax.lax.with_sharding_constraint(
      x, activation_sharding(mesh, kind, x.shape))


def place_batch(batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
  """Global arrays from this process's rows of the batch (split over
  data × fsdp along the leading axis), via
  `jax.make_array_from_process_local_data`: on one host the local rows are
  the whole batch; on several, each host passes only its own rows."""
  out = {}
  for name, local in batch.items():
    local = np.asarray(local)
    spec = P(BATCH_AXES, *([None] * (local.ndim - 1)))
    sharding = NamedSharding(mesh, spec)
    global_shape = (local.shape[0] * jax.process_count(), *local.shape[1:])
    out[name] = jax.make_array_from_process_local_data(sharding, local,
                                                       global_shape)
  return out
