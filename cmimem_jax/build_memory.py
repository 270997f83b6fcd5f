"""Builds memory banks session by session and shows what retrieval
recovers: the work is `task.build_memory.run`.

  python -m cmimem_jax.build_memory --config=configs/build_memory.py --workdir=DIR
"""

from absl import flags

from cmimem_jax.config import run_command
from cmimem_jax.task.build_memory import run


def main(argv: list[str]) -> None:
  del argv
  run(flags.FLAGS.config, flags.FLAGS.workdir)


if __name__ == "__main__":
  run_command(main)
