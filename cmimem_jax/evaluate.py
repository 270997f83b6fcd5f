"""Scores a memory method on LongMemEval, LoCoMo or MemoryAgentBench: the
work is `evaluation.run.evaluate`.

  python -m cmimem_jax.evaluate --config=configs/eval_cpu.py --workdir=DIR \
      [--config.dataset.name=locomo --config.dataset.path=FILE] \
      [--config.method=rag|prompting|policy] \
      [--config.judge.kind=context_recall|llm] [--config.limit=N]

`results.json` is written whatever failed; the command then exits 1 with
one line naming the endpoints when any question could not be scored
(a failed answer, judge or builder call), unless `--max_failure_rate`
accepts that fraction. A rerun redoes only those questions.
"""

import json

from absl import app, flags

from cmimem_jax.config import check_failures, run_command, validate_config
from cmimem_jax.evaluation.run import (EVALUATION_SECTIONS, evaluate,
                                       failed_endpoints)

flags.DEFINE_float("max_failure_rate", 0.0,
                   "Exit 0 although up to this fraction of the questions "
                   "could not be scored (failed endpoint calls).")


def main(argv: list[str]) -> None:
  del argv
  if not flags.FLAGS.workdir:
    raise app.UsageError("--workdir is required")
  if not 0.0 <= flags.FLAGS.max_failure_rate <= 1.0:
    raise app.UsageError("--max_failure_rate must be in [0, 1]")
  sections = validate_config(flags.FLAGS.config,
                             required=EVALUATION_SECTIONS)
  result = evaluate(sections, flags.FLAGS.workdir)
  print(json.dumps({k: result[k] for k in ("dataset", "method", "judge",
                                           "overall", "by_category", "n",
                                           "failures", "missing")},
                   indent=1), flush=True)
  check_failures(result["failures"] + result["missing"],
                 result["n"] + result["missing"],
                 flags.FLAGS.max_failure_rate,
                 f"questions could not be scored: calls to "
                 f"{failed_endpoints(sections, result)}",
                 "results.json holds the others; a rerun redoes only them")


if __name__ == "__main__":
  run_command(main)
