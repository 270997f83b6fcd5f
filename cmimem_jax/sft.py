"""Supervised warm start on teacher trajectories: the work is
`task.warm_start.run_sft`.

  python -m cmimem_jax.sft --config=configs/small_repro.py --workdir=DIR

Then `python -m cmimem_jax.train ... --config.policy.init_checkpoint=DIR`.
"""

import functools

from absl import app, flags

from cmimem_jax.config import run_command
from cmimem_jax.rl import read_metrics
from cmimem_jax.task.warm_start import run_sft, summary_line


def main(argv: list[str]) -> None:
  del argv
  if not flags.FLAGS.workdir:
    raise app.UsageError("--workdir is required")
  run_sft(flags.FLAGS.config, flags.FLAGS.workdir,
          echo=functools.partial(print, flush=True))
  print(summary_line(read_metrics(flags.FLAGS.workdir), flags.FLAGS.workdir))


if __name__ == "__main__":
  run_command(main)
