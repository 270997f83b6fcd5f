"""CMI-Mem GRPO training (SPEC §5): the loop is `task.loop`.

  python -m cmimem_jax.train --config=configs/tiny.py --workdir=DIR
"""

import functools

from absl import app, flags

from cmimem_jax.config import run_command
from cmimem_jax.task.loop import train


def main(argv: list[str]) -> None:
  del argv
  if not flags.FLAGS.workdir:
    raise app.UsageError("--workdir is required")
  echo = functools.partial(print, flush=True)
  print(train(flags.FLAGS.config, flags.FLAGS.workdir, echo=echo))


if __name__ == "__main__":
  run_command(main)
