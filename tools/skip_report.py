"""Semantic SKIPs in training runs' logged rollouts, by kind of session.

  python -m tools.skip_report DIR [DIR ...] [--steps=FIRST:LAST]
      [--output=FILE.json] [--plot=FILE.png]

Each DIR is a `python -m cmimem_jax.train` (or `tools.reproduce` arm)
workdir run with `rl.log_rollouts` (`DIR/rollouts.jsonl`). Its sessions
are read from the run's own `DIR/config.json` (its `dataset` section) and
split by what the semantic-SKIP judgement weighs (`user_statements`):

  states nothing    the user only asks (common-knowledge questions): a
                    SKIP is justified (App. B), ρ = 0;
  states something  the user states facts: a SKIP is justified only when
                    the semantic store already covers them (their share
                    covered, `semantic_skip_coverage`, at least the
                    encoder's calibrated `reward.semantic_skip_coverage`;
                    runs before 2026-12-07 logged ρ, the largest CMI of
                    a statement, justified below 0.232).

Prints, per run and pooled, the rollouts, semantic SKIPs and SKIPs judged
justified of each kind (as logged by the reward, never recomputed), over
every logged step or those in `--steps` (inclusive), and writes them to
`--output` as JSON; `--plot` draws each run's SKIPs per step and kind.
Exits non-zero when a DIR has no logged rollouts (in those steps) or its
dataset cannot be read. Never modifies a file: a running run can be read.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
from collections.abc import Iterable
from typing import Any

import ml_collections
from absl import app, flags

from cmimem_jax import storage
from cmimem_jax.config import CONFIG_FILE, run_command
from cmimem_jax.data.files import write_figure, write_json
from cmimem_jax.data.fragments import user_statements
from cmimem_jax.data.types import Dialogue
from cmimem_jax.rl import read_rollouts
from cmimem_jax.rl.metrics import ROLLOUTS_FILE
from cmimem_jax.task.loop import training_dialogues

# A run's relative dataset path is read from here as well as from the
# working directory.
REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))

STATES_NOTHING, STATES_SOMETHING = "states nothing", "states something"
KINDS = (STATES_NOTHING, STATES_SOMETHING)


def session_kinds(dialogues: Iterable[Dialogue]) -> dict[str, str]:
  """`"<dialogue_id>/<session index>"` (the rollout records' `session`)
  -> its kind."""
  return {f"{d.dialogue_id}/{s.index}":
          STATES_SOMETHING if user_statements(s.user_turns())
          else STATES_NOTHING
          for d in dialogues for s in d.sessions}


def skip_counts(records: Iterable[dict[str, Any]], kinds: dict[str, str]
                ) -> dict[str, dict[str, float]]:
  """Per kind: `rollouts`, `skips` (semantic SKIPs), `justified` (of those
  judged justified) and `skip_rho_mean` (the score the judgement
  compared: coverage, or ρ in runs logged before the coverage rule; mean
  over the SKIPs; None without SKIPs)."""
  rows: dict[str, dict[str, Any]] = {
      kind: {"rollouts": 0, "skips": 0, "justified": 0, "rhos": []}
      for kind in KINDS}
  for record in records:
    row = rows[kinds[record["session"]]]
    row["rollouts"] += 1
    if record.get("semantic_skip"):
      row["skips"] += 1
      row["justified"] += int(record["semantic_skip_justified"])
      row["rhos"].append(record["semantic_skip_coverage"]
                         if "semantic_skip_coverage" in record
                         else record["semantic_skip_rho"])
  for row in rows.values():
    rhos = row.pop("rhos")
    row["skip_rho_mean"] = sum(rhos) / len(rhos) if rhos else None
  return rows


def run_kinds(workdir: str) -> dict[str, str]:
  """The session kinds of the run in `workdir`, from its config.json. A
  relative dataset path is read from here or, failing that, from the
  repository root (where the documented commands run)."""
  dataset = ml_collections.ConfigDict(json.loads(storage.path(
      storage.join(workdir, CONFIG_FILE)).read_text())["dataset"])
  if not storage.path(dataset.path).exists():
    from_root = os.path.join(REPO, dataset.path)
    if os.path.isabs(dataset.path) or not os.path.exists(from_root):
      raise FileNotFoundError(
          f"{workdir}: the run's dataset {dataset.path!r} is not found here "
          f"or under {REPO}")
    dataset.path = from_root
  return session_kinds(training_dialogues(dataset))


def markdown(counts: dict[str, dict[str, dict[str, float]]]) -> str:
  """The table: a row per (run, kind)."""
  lines = ["| run | session kind | rollouts | semantic SKIPs | judged "
           "justified | mean score of the SKIPs (coverage; ρ before 2026-12-07) "
           "|", "|---|---|---|---|---|---|"]
  for run, rows in counts.items():
    for kind in KINDS:
      row = rows[kind]
      rho = ("—" if row["skip_rho_mean"] is None
             else f"{row['skip_rho_mean']:.3f}")
      lines.append(f"| {run} | {kind} | {row['rollouts']} | {row['skips']} "
                   f"| {row['justified']} | {rho} |")
  return "\n".join(lines)


def pooled(runs: Iterable[dict[str, dict[str, float]]]
           ) -> dict[str, dict[str, float]]:
  """Per kind, the runs' counts summed (ρ's mean weighted by SKIPs)."""
  runs = list(runs)
  out = {}
  for kind in KINDS:
    rows = [r[kind] for r in runs]
    skips = sum(r["skips"] for r in rows)
    out[kind] = {
        "rollouts": sum(r["rollouts"] for r in rows), "skips": skips,
        "justified": sum(r["justified"] for r in rows),
        "skip_rho_mean": (sum(r["skip_rho_mean"] * r["skips"] for r in rows
                              if r["skips"]) / skips if skips else None)}
  return out


def plot(runs: dict[str, list[dict[str, Any]]],
         kinds: dict[str, dict[str, str]],
         counts: dict[str, dict[str, dict[str, float]]], path: str) -> None:
  """One panel per run: its semantic SKIPs per step, a bar per kind of
  session, labelled with the run's `counts` (`skip_counts`)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 3.6),
                           squeeze=False, sharey=True)
  for ax, (run, records) in zip(axes[0], runs.items()):
    by_step: dict[int, list[dict[str, Any]]] = {}
    for record in records:
      by_step.setdefault(record["step"], []).append(record)
    steps = sorted(by_step)
    per_step = [skip_counts(by_step[step], kinds[run]) for step in steps]
    for offset, kind, color in ((-0.2, STATES_NOTHING, "tab:green"),
                                (0.2, STATES_SOMETHING, "tab:red")):
      total = counts[run][kind]
      ax.bar([step + offset for step in steps],
             [c[kind]["skips"] for c in per_step], width=0.4, color=color,
             label=f"user {kind}: {total['skips']} SKIPs, "
                   f"{total['justified']} justified")
    ax.set(title=os.path.join(*pathlib.Path(run).parts[-2:]), xlabel="step",
           xticks=steps)
    ax.legend(fontsize=8, loc="upper left")
  axes[0][0].set_ylabel("semantic SKIPs (rollouts)")
  fig.tight_layout()
  write_figure(fig, path)
  plt.close(fig)


# This tool's flags (its own: tools share flag names); the workdirs are
# its positional arguments.
FLAGS = flags.FlagValues()
flags.DEFINE_string("steps", "", "FIRST:LAST: only these training steps "
                    "(inclusive).", flag_values=FLAGS)
flags.DEFINE_string("output", "", "Also write the counts to this JSON file.",
                    flag_values=FLAGS)
flags.DEFINE_string("plot", "", "Also draw the SKIPs per step to this PNG.",
                    flag_values=FLAGS)


def main(argv: list[str]) -> int:
  """`argv`: the program, then the workdirs (DIR [DIR ...])."""
  args, workdirs = FLAGS, argv[1:]
  if not workdirs:
    raise app.UsageError("give the workdirs: DIR [DIR ...]")
  first, last = 1, float("inf")
  if args.steps:
    bounds = args.steps.split(":")
    if len(bounds) != 2 or not all(b.isdigit() for b in bounds):
      raise app.UsageError(f"--steps={args.steps}: expected FIRST:LAST, "
                           "e.g. 1:5")
    first, last = int(bounds[0]), int(bounds[1])
    if first > last:
      raise app.UsageError(f"--steps={args.steps}: FIRST is after LAST")
  counts, runs, kinds = {}, {}, {}
  for workdir in workdirs:
    try:
      found = storage.path(workdir).is_dir()
    except storage.StorageError as e:
      print(e, file=sys.stderr)
      return 1
    if not found:
      print(f"{workdir}: no such directory", file=sys.stderr)
      return 1
    try:
      logged = read_rollouts(workdir)  # Names the file and line if torn.
    except ValueError as e:
      print(e, file=sys.stderr)
      return 1
    malformed = next((i for i, r in enumerate(logged, 1)
                      if not isinstance(r, dict)
                      or not isinstance(r.get("step"), int)
                      or not isinstance(r.get("session"), str)), None)
    if malformed is not None:
      print(f"{os.path.join(workdir, ROLLOUTS_FILE)}: record {malformed} is "
            "not a rollout record (it needs an integer step and a session)",
            file=sys.stderr)
      return 1
    if not logged:
      print(f"{workdir}: no logged rollouts (rollouts.jsonl; the run needs "
            "rl.log_rollouts=True)", file=sys.stderr)
      return 1
    records = [r for r in logged if first <= r["step"] <= last]
    if not records:
      print(f"{workdir}: no logged rollouts in steps {first}..{last} (it "
            f"logged steps {logged[0]['step']}..{logged[-1]['step']})",
            file=sys.stderr)
      return 1
    try:
      kinds[workdir] = run_kinds(workdir)
    except (OSError, ValueError) as e:
      print(e, file=sys.stderr)
      return 1
    unknown = {r["session"] for r in records} - set(kinds[workdir])
    if unknown:
      print(f"{os.path.join(workdir, ROLLOUTS_FILE)}: rollouts of sessions "
            f"not in the run's dataset: {sorted(unknown)[:3]}",
            file=sys.stderr)
      return 1
    runs[workdir] = records
    counts[workdir] = skip_counts(records, kinds[workdir])
  if len(workdirs) > 1:
    counts["pooled"] = pooled(counts[w] for w in workdirs)
  print(markdown(counts))
  if args.output:
    write_json(args.output, counts)
  if args.plot:
    plot(runs, kinds, counts, args.plot)
  return 0


if __name__ == "__main__":
  run_command(main, flag_values=FLAGS, compilation_cache=False,
              positional=True)
