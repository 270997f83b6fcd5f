"""Our evaluation results beside the paper's published numbers.

  python -m tools.compare_paper --results=/tmp/eval_locomo[,/tmp/eval_lme] \
      [--format=markdown|json] [--out=FILE]

Each DIR is a `python -m cmimem_jax.evaluate` workdir (`results.json`,
`settings.json`). For every paper table that reports its benchmark
(Table 1 for LoCoMo; Tables 1, 3 and 9 for LongMemEval) it prints the
paper's rows, ours, the difference to the reference row (the matching RAG
row for a `rag` run, else CMI-Mem), and the settings under the table, with
those that differ from the paper's marked.
"""

from __future__ import annotations

import json
import sys

from absl import app, flags

from cmimem_jax import storage
from cmimem_jax.config import run_command
from cmimem_jax.evaluation.paper import OurResult, compare, to_markdown

# This tool's flags (its own: tools share flag names).
FLAGS = flags.FlagValues()
flags.DEFINE_string("results", None, "Evaluation workdirs, comma separated.",
                    flag_values=FLAGS, required=True)
flags.DEFINE_enum("format", "markdown", ("markdown", "json"),
                  "How the comparison is printed.", flag_values=FLAGS)
flags.DEFINE_string("out", "", "Also write to this file.", flag_values=FLAGS)


def main(argv: list[str]) -> list[dict]:
  del argv
  args = FLAGS
  workdirs = [d for d in args.results.split(",") if d]
  try:
    missing = [path for path in (storage.join(d, "results.json")
                                 for d in workdirs)
               if not storage.path(path).exists()]
  except storage.StorageError as e:
    raise app.UsageError(str(e)) from e
  if missing or not workdirs:
    raise app.UsageError(
        f"no {', '.join(missing) or 'workdir'} (--results takes `python -m "
        "cmimem_jax.evaluate` workdirs, comma separated)")
  # A garbage or unreadable file: its ValueError / OSError is the line.
  ours = [OurResult.load(d) for d in workdirs]
  comparisons = compare(ours)
  text = (to_markdown(comparisons) if args.format == "markdown"
          else json.dumps(comparisons, indent=1) + "\n")
  sys.stdout.write(text)
  if args.out:
    storage.write_atomic(args.out, text)
  return comparisons


if __name__ == "__main__":
  run_command(main, flag_values=FLAGS, compilation_cache=False)
