"""Scores a memory method on LongMemEval, LoCoMo or MemoryAgentBench: the
work is `evaluation.run.evaluate`.

  python -m cmimem_jax.evaluate --config=configs/eval_cpu.py --workdir=DIR \
      [--config.dataset.name=locomo --config.dataset.path=FILE] \
      [--config.method=rag|prompting|policy] \
      [--config.judge.kind=context_recall|llm] [--config.limit=N]
"""

import json

from absl import app, flags

from cmimem_jax.config import run_command
from cmimem_jax.evaluation.run import evaluate


def main(argv: list[str]) -> None:
  del argv
  if not flags.FLAGS.workdir:
    raise app.UsageError("--workdir is required")
  result = evaluate(flags.FLAGS.config, flags.FLAGS.workdir)
  print(json.dumps({k: result[k] for k in ("dataset", "method", "judge",
                                           "overall", "by_category", "n",
                                           "failures")}, indent=1))


if __name__ == "__main__":
  run_command(main)
