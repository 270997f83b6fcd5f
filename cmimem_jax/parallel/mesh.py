"""Device meshes from the config, and multi-host start-up.

The mesh always has the axes `("data", "fsdp", "tensor")` (SPEC §5): the
batch is split over `data` × `fsdp`, parameters over `fsdp` (ZeRO-3 style)
and `tensor` (Megatron style). An axis size of -1 takes the devices left.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Iterator, Mapping
from typing import ClassVar

import jax
import numpy as np
from jax.sharding import Mesh

from cmimem_jax.config import Section

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")


def parse_mesh_shape(text: str) -> dict[str, int]:
  """`"fsdp:4,tensor:2"` -> `{"data": 1, "fsdp": 4, "tensor": 2}`."""
  shape = {axis: 1 for axis in AXES}
  for part in filter(None, (p.strip() for p in text.split(","))):
    name, _, size = part.partition(":")
    if name not in AXES or not size.lstrip("-").isdigit():
      raise ValueError(f"bad mesh entry {part!r}; expected AXIS:SIZE with "
                       f"AXIS in {AXES}")
    shape[name] = int(size)
  return shape


@dataclasses.dataclass(frozen=True)
class MeshConfig(Section):
  """The top-level `mesh` field: "AXIS:SIZE,..." over `AXES` (-1: the
  devices left), checked against this process's devices."""

  SECTION: ClassVar[str] = ""  # A field of the top level.

  mesh: str

  def invalid(self) -> Iterator[str]:
    try:
      self.sizes()
    except ValueError as e:
      yield f"mesh={self.mesh!r}: {e}"

  def sizes(self) -> dict[str, int]:
    """`{axis: size}` on this process's devices (raises ValueError)."""
    return resolve_mesh_shape(parse_mesh_shape(self.mesh), len(jax.devices()))

  @property
  def batch_shards(self) -> int:
    """How many ways the batch is split (`data` x `fsdp`)."""
    sizes = self.sizes()
    return math.prod(sizes[axis] for axis in BATCH_AXES)


def resolve_mesh_shape(shape: Mapping[str, int], num_devices: int
                       ) -> dict[str, int]:
  """Fills one -1 axis and checks the product equals `num_devices`."""
  unknown = [axis for axis in AXES if shape.get(axis, 1) == -1]
  sizes = {axis: shape.get(axis, 1) for axis in AXES}
  extra = set(shape) - set(AXES)
  if extra:
    raise ValueError(f"unknown mesh axes {sorted(extra)}; known: {AXES}")
  if len(unknown) > 1:
    raise ValueError(f"at most one mesh axis may be -1, got {unknown}")
  if any(size < 1 for axis, size in sizes.items() if axis not in unknown):
    raise ValueError(f"mesh axis sizes must be positive: {sizes}")
  known = math.prod(size for axis, size in sizes.items()
                    if axis not in unknown)
  if unknown:
    if num_devices % known:
      raise ValueError(f"mesh {sizes}: {num_devices} devices are not a "
                       f"multiple of {known}")
    sizes[unknown[0]] = num_devices // known
  if math.prod(sizes.values()) != num_devices:
    raise ValueError(f"mesh {sizes} needs {math.prod(sizes.values())} "
                     f"devices but {num_devices} are available")
  return sizes


def make_mesh(shape: Mapping[str, int] | str,
              devices: list[jax.Device] | None = None) -> Mesh:
  """A `("data", "fsdp", "tensor")` mesh over `devices` (default: all)."""
  if isinstance(shape, str):
    shape = parse_mesh_shape(shape)
  devices = list(jax.devices() if devices is None else devices)
  sizes = resolve_mesh_shape(shape, len(devices))
  grid = np.array(devices).reshape([sizes[axis] for axis in AXES])
  return Mesh(grid, AXES)


def batch_divisor(mesh: Mesh) -> int:
  """How many ways the batch dimension is split."""
  return math.prod(mesh.shape[axis] for axis in BATCH_AXES)


def initialize_distributed() -> bool:
  """Calls `jax.distributed.initialize()` when this is one of several
  processes (coordinator address in the environment, as set by
  `tools/launch` scripts, SLURM or a TPU pod); returns whether it did."""
  if jax.distributed.is_initialized():
    return True
  address = os.environ.get("JAX_COORDINATOR_ADDRESS")
  if not address and "TPU_WORKER_HOSTNAMES" not in os.environ:
    return False
  kwargs = {}
  if address:
    kwargs = dict(coordinator_address=address,
                  num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
                  process_id=int(os.environ["JAX_PROCESS_ID"]))
  jax.distributed.initialize(**kwargs)
  logging.info("jax.distributed: process %d of %d", jax.process_index(),
               jax.process_count())
  return True
