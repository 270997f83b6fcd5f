"""Stopping a training job cleanly on SIGTERM (a TPU VM's preemption
notice) or SIGINT (Ctrl-C): the signal only sets a flag, the loop saves a
checkpoint at the next step boundary, flushes its metrics and raises
`config.Interrupted` (exit code 128 + the signal). Nothing is torn: no
exception lands inside a compiled step, a checkpoint write or a metrics
line. A second Ctrl-C interrupts at once."""

from __future__ import annotations

import signal
import threading
from typing import Any

import jax
from absl import logging

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
  """`with StopSignals() as stop:` — `stop.signum` is the first stop signal
  received (None until then). Handlers are installed only in the main
  thread and restored on exit."""

  def __init__(self):
    self.signum: int | None = None
    self._previous: dict[int, Any] = {}

  def __enter__(self) -> StopSignals:
    if threading.current_thread() is threading.main_thread():
      for signum in STOP_SIGNALS:
        self._previous[signum] = signal.signal(signum, self._handle)
    return self

  def __exit__(self, *exc: object) -> None:
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    self._previous.clear()

  def _handle(self, signum: int, frame: Any) -> None:
    del frame
    if self.signum is not None and signum == signal.SIGINT:
      raise KeyboardInterrupt  # Asked twice: stop now.
    if self.signum is None:
      self.signum = signum
      logging.warning("%s received: saving a checkpoint after the current "
                      "step, then stopping", signal.Signals(signum).name)

  def requested(self, step: int, checkpoint_manager: Any = None) -> bool:
    """Whether to stop after `step`: a signal here, or (multi-host) JAX's
    preemption sync point reached on every host."""
    if self.signum is not None:
      return True
    if checkpoint_manager is not None and jax.process_count() > 1:
      if checkpoint_manager.reached_preemption(step):
        self.signum = signal.SIGTERM
        return True
    return False

  def message(self, step: int) -> str:
    name = signal.Signals(self.signum).name if self.signum else "a signal"
    return (f"stopped by {name} after step {step}: checkpoint {step} saved; "
            "rerun the same command to resume")
