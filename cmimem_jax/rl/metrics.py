"""Training metrics: one JSON line per step, TensorBoard scalars, and a
progress bar when stderr is a terminal."""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any


class MetricsWriter:

  def __init__(self, workdir: str, total_steps: int | None = None,
               tensorboard: bool = True, progress: bool | None = None):
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._file = open(self.path, "a", encoding="utf-8")
    self._tb = None
    if tensorboard:
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))
    if progress is None:
      progress = sys.stderr.isatty()
    self._bar = None
    if progress:
      from tqdm import tqdm
      self._bar = tqdm(total=total_steps, desc="train", unit="step")

  def write(self, step: int, metrics: dict[str, Any]) -> None:
    """Appends `{"step": step, **metrics}`; non-finite floats become null
    in JSON (and are still visible there) rather than invalid JSON."""
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v)
                 else v) for k, v in metrics.items()}
    self._file.write(json.dumps({"step": step, **clean}) + "\n")
    self._file.flush()
    if self._tb is not None:
      for name, value in metrics.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
          self._tb.add_scalar(name, value, step)
    if self._bar is not None:
      self._bar.update(1)
      shown = {k: metrics[k] for k in ("loss", "reward_mean") if k in metrics}
      self._bar.set_postfix({k: f"{v:.4g}" for k, v in shown.items()})

  def close(self) -> None:
    self._file.close()
    if self._tb is not None:
      self._tb.close()
    if self._bar is not None:
      self._bar.close()


def read_metrics(workdir: str) -> list[dict[str, Any]]:
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]
