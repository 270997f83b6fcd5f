"""Training metrics: one JSON line per step, TensorBoard scalars, and a
progress bar when stderr is a terminal, in a local or a `gs://` workdir.

Each file is appended through `storage.Appender` and flushed after every
step: locally an append-mode file, on object storage one compose of the
step's bytes onto the object (GCS cannot append in place). A run killed
(or preempted) mid-step loses at most that step's records, the same
records the resume rule drops anyway: a rerun resumes from its newest
checkpoint, and every record of a later step, written before the run
died, is removed first (they run again). TensorBoard's event files go
through the same appender (tensorboardX's own gs:// writer re-uploads the
whole file at every flush).
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any

from absl import logging

from cmimem_jax import storage
from cmimem_jax.data.files import read_jsonl, rewrite_jsonl


def _summary_writer_class() -> type:
  """tensorboardX's `SummaryWriter`, imported without torch.

  Its writer module imports torch whenever it is installed (the test
  extra installs it), only to accept torch tensors; we log Python floats.
  That import costs 1.5-3 s and ~0.2 GiB in every train / sft process,
  which run no torch model. While tensorboardX is imported, `import torch`
  fails (a `None` entry in `sys.modules`), and tensorboardX takes its
  no-torch path; a torch imported before is left alone.
  """
  if "torch" in sys.modules:
    from tensorboardX import SummaryWriter
    return SummaryWriter
  sys.modules["torch"] = None  # type: ignore[assignment]
  try:
    from tensorboardX import SummaryWriter
  finally:
    del sys.modules["torch"]
  return SummaryWriter


class _EventFiles:
  """tensorboardX's writer factory for `gs://` event files: each through
  `storage.Appender` (its own factory needs google-cloud-storage and
  uploads the whole file at every flush)."""

  def open(self, location: str) -> storage.Appender:
    storage.remove(location)  # A new file, as tensorboardX's local "wb".
    return storage.Appender(location, "ab")

  def directory_check(self, location: str) -> None:
    storage.path(location)  # Object storage has no directories.


def _route_event_files() -> None:
  from tensorboardX import record_writer
  for scheme in storage.SCHEMES:
    record_writer.register_writer_factory(scheme, _EventFiles())


# Per-rollout records (`rl.log_rollouts`), beside metrics.jsonl.
ROLLOUTS_FILE = "rollouts.jsonl"


def _open_from_step(path: str, start_step: int) -> storage.Appender:
  """`path` opened for appending, its records of steps after `start_step`
  removed first (they run again from the checkpoint)."""
  records = read_jsonl(path)
  kept = [r for r in records if r.get("step", 0) <= start_step]
  if len(kept) < len(records):
    logging.warning("%s: dropping %d records of steps after %d (they run "
                    "again from the checkpoint)", path,
                    len(records) - len(kept), start_step)
    rewrite_jsonl(path, kept)
  return storage.Appender(path)


class MetricsWriter:
  """Appends step metrics to `workdir/metrics.jsonl` (and TensorBoard),
  and with `rollouts` each rollout's record to `workdir/rollouts.jsonl`.

  `start_step`: the step training resumes from. Records of later steps (a
  run that crashed after them but before its next checkpoint) are removed,
  from the JSONL files and from TensorBoard (`purge_step`), since those
  steps run again; a torn last line from a killed writer is dropped.
  """

  def __init__(self, workdir: str, total_steps: int | None = None,
               tensorboard: bool = True, progress: bool | None = None,
               start_step: int = 0, rollouts: bool = False):
    storage.makedirs(workdir)
    self.path = storage.join(workdir, "metrics.jsonl")
    self._file = _open_from_step(self.path, start_step)
    # `write_rollouts`' file, under the same resume rule.
    self._rollouts = (_open_from_step(storage.join(workdir, ROLLOUTS_FILE),
                                      start_step) if rollouts else None)
    self._tb = None
    if tensorboard:
      writer_class = _summary_writer_class()
      _route_event_files()
      self._tb = writer_class(storage.join(workdir, "tensorboard"),
                              purge_step=start_step + 1)
    if progress is None:
      progress = sys.stderr.isatty()
    self._bar = None
    if progress:
      from tqdm import tqdm
      self._bar = tqdm(total=total_steps, desc="train", unit="step")

  def write(self, step: int, metrics: dict[str, Any]) -> None:
    """Appends `{"step": step, **metrics}`. Non-finite floats (the loss of
    a skipped update, say) are left out and named in `nonfinite`, so every
    value in the file is a number and the file strict JSON."""
    nonfinite = sorted(k for k, v in metrics.items()
                       if isinstance(v, float) and not math.isfinite(v))
    clean = {k: v for k, v in metrics.items() if k not in nonfinite}
    if nonfinite:
      clean["nonfinite"] = nonfinite
    self._file.write(json.dumps({"step": step, **clean}) + "\n")
    self._file.flush()
    if self._tb is not None:
      for name, value in clean.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
          self._tb.add_scalar(name, value, step)
    if self._bar is not None:
      self._bar.update(1)
      shown = {k: clean[k] for k in ("loss", "reward_mean") if k in clean}
      self._bar.set_postfix({k: f"{v:.4g}" for k, v in shown.items()})

  def write_rollouts(self, step: int, records: list[dict[str, Any]]) -> None:
    """Appends one line per rollout of `step` to `ROLLOUTS_FILE`."""
    if self._rollouts is None:
      raise ValueError("this MetricsWriter was opened with rollouts=False")
    for record in records:
      self._rollouts.write(json.dumps({"step": step, **record}) + "\n")
    self._rollouts.flush()

  def truncate_after(self, step: int) -> None:
    """Closes the JSONL files and cuts the records of steps after `step`
    from them, in place (a full disk has no room for a rewritten copy): a
    failed checkpoint save leaves them ending at the last saved step."""
    for file in (self._file, self._rollouts):
      if file is None or file.closed:
        continue
      try:
        # Closed first: a buffered tail the full disk refused now is never
        # written after the cut.
        file.close()
      except OSError:
        pass
      if storage.is_remote(file.location):
        # Object storage has no in-place truncation; the object is
        # rewritten whole (no disk of this host to fill).
        rewrite_jsonl(file.location, [
            r for r in read_jsonl(file.location, repair=False)
            if r.get("step", 0) <= step])
        continue
      offset = 0
      with open(file.location, "rb") as f:
        for line in f:
          try:
            if json.loads(line).get("step", 0) > step:
              break
          except ValueError:  # A torn last line: cut with the rest.
            break
          offset += len(line)
      os.truncate(file.location, offset)

  def close(self) -> None:
    self._file.close()
    if self._rollouts is not None:
      self._rollouts.close()
    if self._tb is not None:
      self._tb.close()
    if self._bar is not None:
      self._bar.close()


# The readers below never modify a file: a run may still be appending to
# it (a torn last line is skipped; `MetricsWriter` repairs it on resume).


def read_metrics(workdir: str) -> list[dict[str, Any]]:
  """Every step's record in `workdir/metrics.jsonl`."""
  return read_jsonl(storage.join(workdir, "metrics.jsonl"), repair=False)


def read_rollouts(workdir: str) -> list[dict[str, Any]]:
  """Every rollout's record in `workdir/rollouts.jsonl` (`rl.log_rollouts`)."""
  return read_jsonl(storage.join(workdir, ROLLOUTS_FILE), repair=False)
