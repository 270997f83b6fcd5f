"""Orbax checkpoints of the learner: params, optimizer state, step, RNG key
and an opaque JSON "loop state" (data position, curriculum, snapshot
version) supplied by the caller.

Saves are asynchronous (the step continues while files are written; the
next save or `wait()` joins it) and keep the newest `keep`, plus every
step divisible by `keep_period` for checkpoint selection (App. I picks
steps 20 and 50). Restore places
every array onto the mesh with the shardings it is given. If the newest
checkpoint cannot be read it is reported and the previous one is used.

A directory may be local or on object storage (`gs://bucket/run/...`):
Orbax writes there natively (its arrays through tensorstore's GCS driver,
the rest through `etils.epath`), committing each step with a
`commit_success.txt` marker instead of a rename; `cmimem_jax.storage`
checks the location first and points both clients at a GCS emulator when
`STORAGE_EMULATOR_HOST` is set.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging as absl_logging
from flax import nnx

from cmimem_jax import storage
from cmimem_jax.models.host_memory import release_free_heap


# Orbax's own default is 96 GB: in effect every array of a save at once.
DEFAULT_SAVE_CONCURRENT_GB = 4.0


def _handlers(save_concurrent_gb: float
              ) -> ocp.handlers.DefaultCheckpointHandlerRegistry:
  """The handler of each item and kind of access: the state saved with at
  most `save_concurrent_gb` GB written at once, restored whole or (the
  parameters alone) in part; the loop state as JSON."""
  registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
  state = ocp.StandardCheckpointHandler(save_concurrent_gb=save_concurrent_gb)
  registry.add("state", ocp.args.StandardSave, state)
  registry.add("state", ocp.args.StandardRestore, state)
  registry.add("state", ocp.args.PyTreeRestore, ocp.PyTreeCheckpointHandler)
  registry.add("loop", ocp.args.JsonSave, ocp.JsonCheckpointHandler)
  registry.add("loop", ocp.args.JsonRestore, ocp.JsonCheckpointHandler)
  return registry


class _ReadOnlyNotice(logging.Filter):
  """Drops orbax's warning that a directory opened read-only is read-only
  (every `read_only=True` Checkpointer asks for exactly that; `make demo`
  would print it on every start from a warm start)."""

  def filter(self, record: logging.LogRecord) -> bool:
    return record.msg != "Given directory is read only=%s"


absl_logging.get_absl_logger().addFilter(_ReadOnlyNotice())


@dataclasses.dataclass
class Restored:
  step: int
  params: Any
  opt_state: Any
  rng: jax.Array
  loop_state: dict[str, Any]
  skipped: list[int]  # Newer steps that could not be restored.


class Checkpointer:

  def __init__(self, directory: str, keep: int = 3, async_save: bool = True,
               keep_period: int = 0, read_only: bool = False,
               save_concurrent_gb: float = DEFAULT_SAVE_CONCURRENT_GB):
    """`keep_period` > 0: checkpoints of steps divisible by it are never
    deleted (besides the newest `keep`). `read_only`: another run's
    directory, only read (nothing created, saved or deleted).
    `save_concurrent_gb`: at most this many GB of arrays are being written
    at once (tensorstore holds an encoded copy of each array it writes:
    unbounded, a save of SmolLM2-135M's parameters and AdamW state added
    1.3 GiB to the process's peak RSS; at 0.25 GB, 0.35 GiB)."""
    if keep < 1:
      raise ValueError("keep must be >= 1")
    if keep_period < 0:
      raise ValueError("keep_period must be >= 0")
    if not save_concurrent_gb > 0:
      raise ValueError(f"save_concurrent_gb must be > 0, got "
                       f"{save_concurrent_gb}")
    # Checked (scheme, client, bucket) before Orbax touches it: gcsfs
    # would create a missing bucket.
    location = storage.check_location(directory)
    self.directory = (os.fspath(storage.path(location))
                      if storage.is_remote(location)
                      else os.path.abspath(location))
    # A read-only manager saves and deletes nothing: the options say so,
    # which orbax would otherwise correct with a warning each.
    self.manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else keep,
            keep_period=keep_period or None,
            save_interval_steps=0 if read_only else 1,
            create=not read_only, read_only=read_only,
            enable_async_checkpointing=async_save),
        handler_registry=_handlers(save_concurrent_gb))

  @classmethod
  def for_workdir(cls, workdir: str, section: Any) -> Checkpointer:
    """`workdir/checkpoints` with a `checkpoint` config section's `keep`,
    `keep_period`, `async_save` and `save_concurrent_gb`."""
    return cls(storage.join(workdir, "checkpoints"), section.keep,
               section.async_save, section.get("keep_period", 0),
               save_concurrent_gb=section.get("save_concurrent_gb",
                                              DEFAULT_SAVE_CONCURRENT_GB))

  def steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def save(self, step: int, params: Any, opt_state: Any, rng: jax.Array,
           loop_state: dict[str, Any]) -> None:
    state = {"params": params, "opt_state": opt_state,
             "rng": jax.random.key_data(rng)}
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        loop=ocp.args.JsonSave(loop_state)))

  def wait(self) -> None:
    """Blocks until every save is written, then hands the heap pages the
    save's host copies left behind back to the OS (tensorstore writes them
    in small blocks: 0.7 GiB stayed resident after saving SmolLM2-135M's
    parameters and AdamW state)."""
    self.manager.wait_until_finished()
    release_free_heap()

  def restore(self, params: Any, opt_state: Any, rng: jax.Array
              ) -> Restored | None:
    """Newest readable checkpoint, arrays placed like the given templates
    (arrays or `ShapeDtypeStruct`s carrying shardings); None if there is
    none at all. Unreadable newer steps are logged and listed in
    `skipped`; if none is readable the last error is raised."""
    self.wait()
    to_abstract = lambda x: jax.ShapeDtypeStruct(  # noqa: E731
        x.shape, x.dtype, sharding=getattr(x, "sharding", None))
    key_data = jax.random.key_data(rng)
    target = {"params": jax.tree.map(to_abstract, params),
              "opt_state": jax.tree.map(to_abstract, opt_state),
              "rng": to_abstract(key_data)}
    skipped, error = [], None
    for step in reversed(self.steps()):
      try:
        out = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target),
            loop=ocp.args.JsonRestore()))
      except Exception as e:  # noqa: BLE001 - any unreadable file.
        logging.warning("checkpoint %d in %s is unreadable (%s: %s); "
                        "falling back to an older one", step, self.directory,
                        type(e).__name__, e)
        skipped.append(step)
        error = e
        continue
      state = out["state"]
      return Restored(step, state["params"], state["opt_state"],
                      jax.random.wrap_key_data(state["rng"],
                                               impl=jax.random.key_impl(rng)),
                      dict(out["loop"] or {}), skipped)
    if error is not None:
      raise RuntimeError(f"no readable checkpoint in {self.directory} "
                         f"(tried {skipped})") from error
    return None

  def restore_params(self, params: Any, step: int = 0) -> tuple[int, Any]:
    """The parameters alone from checkpoint `step` (0: the newest; a warm
    start or an evaluation: another run's weights, whatever its
    optimizer), placed like the templates.

    Raises:
      FileNotFoundError: if the directory holds no checkpoint, or not
        `step`.
    """
    self.wait()
    steps = self.steps()
    if not steps:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    if step and step not in steps:
      raise FileNotFoundError(f"no checkpoint of step {step} in "
                              f"{self.directory} (have {steps})")
    step = step or steps[-1]
    to_abstract = lambda x: jax.ShapeDtypeStruct(  # noqa: E731
        x.shape, x.dtype, sharding=getattr(x, "sharding", None))
    target = {"params": jax.tree.map(to_abstract, params)}
    out = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(
            target, restore_args=ocp.checkpoint_utils.construct_restore_args(
                target), partial_restore=True)))
    return step, out["state"]["params"]

  def close(self) -> None:
    self.manager.close()


def load_model_weights(model: nnx.Module, workdir: str, step: int = 0) -> int:
  """Overwrites `model`'s parameters with checkpoint `step` (0: the
  newest) under `workdir/checkpoints` (a warm start from another run,
  whatever its objective, or a selected checkpoint); returns its step."""
  state = nnx.state(model, nnx.Param)
  step, params = Checkpointer(storage.join(workdir, "checkpoints"),
                              read_only=True).restore_params(
                                  nnx.to_pure_dict(state), step)
  nnx.replace_by_pure_dict(state, params)
  nnx.update(model, state)
  logging.info("model weights from %s (step %d)", workdir, step)
  return step
