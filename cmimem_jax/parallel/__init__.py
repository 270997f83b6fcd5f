"""Device meshes, partition rules and batch placement."""

from cmimem_jax.parallel.mesh import (AXES, BATCH_AXES, MeshConfig,
                                      batch_divisor,
                                      initialize_distributed, make_mesh,
                                      parse_mesh_shape, resolve_mesh_shape)
from cmimem_jax.parallel.partition import (ACTIVATION_RULES, QWEN3_RULES,
                                           activation_sharding, constrain,
                                           optimizer_shardings,
                                           param_shardings, path_name,
                                           place_batch, spec_for)

__all__ = [
    "ACTIVATION_RULES", "AXES", "BATCH_AXES", "MeshConfig", "QWEN3_RULES",
    "activation_sharding", "batch_divisor", "constrain",
    "initialize_distributed", "make_mesh", "optimizer_shardings",
    "param_shardings", "parse_mesh_shape", "path_name", "place_batch",
    "resolve_mesh_shape", "spec_for",
]
