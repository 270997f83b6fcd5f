"""Orbax checkpoints of the learner: params, optimizer state, step, RNG key
and an opaque JSON "loop state" (data position, curriculum, snapshot
version) supplied by the caller.

Saves are asynchronous (the step continues while files are written; the
next save or `wait()` joins it) and keep the newest `keep`, plus every
step divisible by `keep_period` for checkpoint selection (App. I picks
steps 20 and 50). Restore places
every array onto the mesh with the shardings it is given. If the newest
checkpoint cannot be read it is reported and the previous one is used.

A save that fails (a full disk, above all) raises `CheckpointNotSaved`
from `save` or `wait`, whichever joins it: one message naming the
checkpoint and, for a full disk, the bytes a checkpoint holds and what
is free; its temporary directory (`N.orbax-checkpoint-tmp*`) is removed, and
orbax's own reports of the same out-of-space error (a traceback from each
of its threads) are not logged. `metrics_follow_checkpoints` then cuts a
run's metrics back to the last saved step.

A directory may be local or on object storage (`gs://bucket/run/...`):
Orbax writes there natively (its arrays through tensorstore's GCS driver,
the rest through `etils.epath`), committing each step with a
`commit_success.txt` marker instead of a rename; `cmimem_jax.storage`
checks the location first and points both clients at a GCS emulator when
`STORAGE_EMULATOR_HOST` is set.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import glob
import logging
import os
import shutil
import sys
from collections.abc import Iterator
from typing import Any, ClassVar

import jax
import orbax.checkpoint as ocp
from absl import logging as absl_logging
from flax import nnx

from cmimem_jax import storage
from cmimem_jax.config import Section, need, positive_int
from cmimem_jax.models.host_memory import release_free_heap
from cmimem_jax.rl.metrics import MetricsWriter


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


class CheckpointNotSaved(OSError):
  """A checkpoint save failed; the message says which, where and why."""


_NO_SPACE = ("No space left on device", "os_error_code='28'",
             "Disk quota exceeded")


def out_of_space(error: BaseException | None) -> bool:
  """Whether `error` (or an exception it was raised from) is a full disk:
  `OSError(ENOSPC / EDQUOT)`, or tensorstore's RESOURCE_EXHAUSTED error
  with the OS error code 28 that orbax raises as a `ValueError`."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC,
                                                       errno.EDQUOT):
      return True
    if any(text in str(error) for text in _NO_SPACE):
      return True
    error = error.__cause__ or error.__context__
  return False


class _OutOfSpaceReports(logging.Filter):
  """Drops orbax's log records of an out-of-space error (each of its save
  threads logs the same traceback): `Checkpointer.save` / `wait` raise it
  once, as `CheckpointNotSaved`."""

  def filter(self, record: logging.LogRecord) -> bool:
    if f"{os.sep}orbax{os.sep}" not in record.pathname:
      return True
    error = record.exc_info[1] if record.exc_info else None
    return not (out_of_space(error) or any(
        text in record.getMessage() for text in _NO_SPACE))


absl_logging.get_absl_logger().addFilter(_OutOfSpaceReports())


def _closed_loop_callback(unraisable: Any) -> bool:
  """A tensorstore write finishing after orbax closed the event loop that
  awaited it: what a failed save's remaining writes do, one traceback
  each (28 for one tiny checkpoint on a full disk), harmless."""
  frames = []
  trace = unraisable.exc_traceback
  while trace is not None:
    frames.append(trace.tb_frame.f_code.co_name)
    trace = trace.tb_next
  return (unraisable.exc_type is RuntimeError
          and str(unraisable.exc_value) == "Event loop is closed"
          and "call_soon_threadsafe" in frames)


def _install_unraisable_filter() -> None:
  previous = sys.unraisablehook

  def hook(unraisable: Any) -> None:
    if not _closed_loop_callback(unraisable):
      previous(unraisable)
  sys.unraisablehook = hook


_install_unraisable_filter()


def _tree_bytes(tree: Any) -> int:
  return sum(getattr(x, "nbytes", 0) for x in jax.tree.leaves(tree))


def _size(size: float) -> str:
  """`size` bytes for a person: "12.3 MiB"."""
  for unit in ("B", "KiB", "MiB", "GiB"):
    if size < 1024 or unit == "GiB":
      return f"{size:.1f} {unit}" if unit != "B" else f"{size:.0f} B"
    size /= 1024
  raise AssertionError("unreachable")


@dataclasses.dataclass
class Restored:
  step: int
  params: Any
  opt_state: Any
  rng: jax.Array
  loop_state: dict[str, Any]
  skipped: list[int]  # Newer steps that could not be restored.


@dataclasses.dataclass(frozen=True)
class CheckpointConfig(Section):
  """The `checkpoint` section: when a job saves and which saves it keeps."""

  SECTION: ClassVar[str] = "checkpoint"

  every_steps: int   # A save every N steps (and at the end).
  keep: int          # The newest N saves are kept.
  keep_period: int = 0  # ... and every Nth step's (0: none).
  async_save: bool = True
  save_concurrent_gb: float = DEFAULT_SAVE_CONCURRENT_GB

  def invalid(self) -> Iterator[str]:
    for key in ("every_steps", "keep"):
      yield from need(self, key, positive_int, "a positive integer")
    yield from need(self, "keep_period", lambda v: v >= 0, ">= 0 (0: none)")
    yield from need(self, "save_concurrent_gb", lambda v: v > 0, "> 0")


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
            # A save killed mid-write leaves its temporary directory.
            cleanup_tmp_directories=not read_only,
            enable_async_checkpointing=async_save),
        handler_registry=_handlers(save_concurrent_gb))
    # (step, bytes) of the save being written in the background.
    self._pending: tuple[int, int] | None = None

  @classmethod
  def for_workdir(cls, workdir: str, section: CheckpointConfig
                  ) -> Checkpointer:
    """`workdir/checkpoints` with a `checkpoint` config section's `keep`,
    `keep_period`, `async_save` and `save_concurrent_gb`."""
    return cls(storage.join(workdir, "checkpoints"), section.keep,
               section.async_save, section.keep_period,
               save_concurrent_gb=section.save_concurrent_gb)

  def steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def save(self, step: int, params: Any, opt_state: Any, rng: jax.Array,
           loop_state: dict[str, Any]) -> None:
    """Starts saving checkpoint `step` (written in the background).

    Raises:
      CheckpointNotSaved: this save, or the previous one it joins first,
        failed.
    """
    state = {"params": params, "opt_state": opt_state,
             "rng": jax.random.key_data(rng)}
    self._join()  # A failure of the previous save is reported as its own.
    self._pending = (step, _tree_bytes(state))
    with self._reporting_failure():
      self.manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state),
          loop=ocp.args.JsonSave(loop_state)))

  def wait(self) -> None:
    """Blocks until every save is written, then hands the heap pages the
    save's host copies left behind back to the OS (tensorstore writes them
    in small blocks: 0.7 GiB stayed resident after saving SmolLM2-135M's
    parameters and AdamW state).

    Raises:
      CheckpointNotSaved: the save in progress failed.
    """
    self._join()
    release_free_heap()

  def _join(self) -> None:
    with self._reporting_failure():
      self.manager.wait_until_finished()
    self._pending = None

  @contextlib.contextmanager
  def _reporting_failure(self) -> Iterator[None]:
    """Turns a failure of the save in progress into `CheckpointNotSaved`,
    after removing its temporary directory."""
    try:
      yield
    except Exception as error:  # noqa: BLE001 - any failed write.
      step, size = self._pending or ("?", 0)
      self._pending = None
      for staging in glob.glob(os.path.join(
          self.directory, f"{step}.orbax-checkpoint-tmp*")):
        shutil.rmtree(staging, ignore_errors=True)
      where = os.path.join(self.directory, str(step))
      if out_of_space(error):
        free = shutil.disk_usage(self.directory).free
        cause = (f"no space left on the device (a checkpoint holds "
                 f"{_size(size)} of arrays, before compression; "
                 f"{_size(free)} free with its partial files removed)")
      else:
        cause = f"{type(error).__name__}: {' '.join(str(error).split())}"
      raise CheckpointNotSaved(f"checkpoint {where} not saved: {cause}"
                               ) from error

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


@contextlib.contextmanager
def metrics_follow_checkpoints(checkpointer: Checkpointer,
                               writer: MetricsWriter) -> Iterator[None]:
  """Nothing logged that was not saved: when a save fails inside, the
  writer's files are cut back to the last saved step (which a rerun
  resumes from) and the error says so."""
  try:
    yield
  except CheckpointNotSaved as error:
    saved = checkpointer.steps()
    last = saved[-1] if saved else 0
    writer.truncate_after(last)
    resume = (f"rerun to resume from step {last}" if saved
              else "rerun to start again")
    raise CheckpointNotSaved(
        f"{error}; {writer.path} ends at step {last}, the last saved "
        f"checkpoint: free space, then {resume}") from error.__cause__


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
