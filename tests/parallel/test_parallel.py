"""Meshes, partition rules and batch placement on the 8 fake CPU devices."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from cmimem_jax.models.qwen3 import Qwen3, preset
from cmimem_jax.parallel import (make_mesh, param_shardings, parse_mesh_shape,
                                 place_batch, resolve_mesh_shape, spec_for)


def test_mesh_shapes_and_validation():
  assert parse_mesh_shape("fsdp:4,tensor:2") == {"data": 1, "fsdp": 4,
                                                 "tensor": 2}
  assert resolve_mesh_shape({"fsdp": -1, "tensor": 2}, 8)["fsdp"] == 4
  with pytest.raises(ValueError, match="needs 6 devices but 8"):
    resolve_mesh_shape({"fsdp": 3, "tensor": 2}, 8)
  with pytest.raises(ValueError, match="at most one"):
    resolve_mesh_shape({"fsdp": -1, "tensor": -1}, 8)
  with pytest.raises(ValueError, match="bad mesh entry"):
    parse_mesh_shape("model:2")
  mesh = make_mesh("data:2,fsdp:2,tensor:2")
  assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}


def test_every_qwen3_parameter_has_a_rule_and_is_sharded():
  mesh = make_mesh("fsdp:4,tensor:2")
  model = Qwen3(preset("tiny"), rngs=nnx.Rngs(0))
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  shardings = param_shardings(params, mesh)
  assert shardings["layers"]["q_proj"].spec == P(None, "fsdp", "tensor")
  assert shardings["layers"]["o_proj"].spec == P(None, "tensor", "fsdp")
  # The vocabulary over tensor x fsdp: the LM head is vocabulary-parallel.
  assert shardings["embed"].spec == P(("tensor", "fsdp"))
  assert shardings["final_norm"].spec == P()
  # A dimension the axis does not divide stays whole.
  assert spec_for("layers.q_proj", (2, 6, 10), [(r"q_proj", P(
      None, "fsdp", "tensor"))], mesh) == P(None, None, "tensor")
  with pytest.raises(ValueError, match="no partition rule matches"):
    spec_for("mystery", (4,), [], mesh)


def test_place_batch_splits_rows_over_data_and_fsdp():
  mesh = make_mesh("data:2,fsdp:2,tensor:2")
  rows = np.arange(16 * 3).reshape(16, 3)
  placed = place_batch({"tokens": rows}, mesh)["tokens"]
  np.testing.assert_array_equal(np.asarray(placed), rows)
  assert placed.sharding.spec == P(("data", "fsdp"), None)
  assert {s.data.shape for s in placed.addressable_shards} == {(4, 3)}
  assert len(jax.devices()) == 8
