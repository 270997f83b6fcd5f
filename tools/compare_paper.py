"""Our evaluation results beside the paper's published numbers.

  python tools/compare_paper.py --results=/tmp/eval_locomo[,/tmp/eval_lme] \
      [--format=markdown|json] [--out=FILE]

Each DIR is an `python -m cmimem_jax.evaluate` workdir (`results.json`,
`settings.json`). For every paper table that reports its benchmark
(Table 1 for LoCoMo; Tables 1, 3 and 9 for LongMemEval) it prints the
paper's rows, ours, the difference to the reference row (the matching RAG
row for a `rag` run, else CMI-Mem), and the settings under the table, with
those that differ from the paper's marked.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from cmimem_jax import storage  # noqa: E402
from cmimem_jax.evaluation.paper import (OurResult, compare,  # noqa: E402
                                         to_markdown)


def main(argv: list[str] | None = None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--results", required=True,
                      help="evaluation workdirs, comma separated")
  parser.add_argument("--format", choices=("markdown", "json"),
                      default="markdown")
  parser.add_argument("--out", default="", help="also write to this file")
  args = parser.parse_args(argv)
  workdirs = [d for d in args.results.split(",") if d]
  try:
    missing = [path for path in (storage.join(d, "results.json")
                                 for d in workdirs)
               if not storage.path(path).exists()]
  except storage.StorageError as e:
    parser.exit(2, f"{parser.prog}: error: {e}\n")
  if missing or not workdirs:
    parser.exit(2, f"{parser.prog}: error: no {', '.join(missing) or 'workdir'}"
                " (--results takes `python -m cmimem_jax.evaluate` workdirs,"
                " comma separated)\n")
  try:
    ours = [OurResult.load(d) for d in workdirs]
  except (OSError, ValueError) as e:  # A garbage or unreadable file.
    parser.exit(1, f"{parser.prog}: error: {e}\n")
  comparisons = compare(ours)
  text = (to_markdown(comparisons) if args.format == "markdown"
          else json.dumps(comparisons, indent=1) + "\n")
  sys.stdout.write(text)
  if args.out:
    storage.write_atomic(args.out, text)
  return comparisons


if __name__ == "__main__":
  main()
