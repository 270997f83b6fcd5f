"""The small reproduction, end to end: warm start -> GRPO -> held-out
evaluation of the initial, warm-started and RL policies, with a results
table and plots.

  python tools/reproduce.py --config=configs/small_repro.py --workdir=DIR

Steps (each resumes or is skipped when its output exists, so a rerun
continues after a crash):
1. `DIR/sft_data.jsonl`: LoCoMo annotation trajectories of
   `repro.teacher_dialogues` (`tools/make_sft_data.py`'s teacher (a)).
2. `DIR/sft/`: the warm start (`python -m cmimem_jax.sft`).
3. `DIR/rl/`: GRPO from the warm start (`python -m cmimem_jax.train`).
4. `DIR/eval/{initial,warm_start,rl}/`: `cmimem_jax.evaluate` with
   `method=policy` on `repro.eval_dialogues`.
5. `DIR/RESULTS.md` (the split, the per-category table, the commands'
   wall times) and `DIR/*.png` (every reward term, validity, response
   length and KL per GRPO step; the warm-start loss).
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from absl import app, flags  # noqa: E402

from cmimem_jax.config import define_command_line_flags  # noqa: E402
from cmimem_jax.data import load_dataset  # noqa: E402
from cmimem_jax.encoders import make_encoder  # noqa: E402
from cmimem_jax.evaluation.run import evaluate  # noqa: E402
from cmimem_jax.rl import read_metrics  # noqa: E402
from cmimem_jax.task.loop import train  # noqa: E402
from cmimem_jax.task.warm_start import (annotation_trajectories,  # noqa: E402
                                        run_sft, write_jsonl)

POLICIES = ("initial", "warm_start", "rl")


def _slice(text: str) -> slice:
  start, _, stop = text.partition(":")
  return slice(int(start) if start else None, int(stop) if stop else None)


def _timed(wall: dict[str, float], name: str, fn, *args):
  start = time.perf_counter()
  out = fn(*args)
  wall[name] = round(time.perf_counter() - start, 1)
  return out


def reward_terms(rl_metrics: list[dict]) -> list[str]:
  """The reward terms to plot. Counts (`reward/num_*`) live on another
  scale and would flatten the terms."""
  return sorted(k for k in rl_metrics[0]
                if k.startswith("reward/") and not k.startswith("reward/num_"))


def plot_training(rl_metrics: list[dict], sft_metrics: list[dict],
                  directory: str) -> list[str]:
  """The PNGs: reward terms, validity / length / KL per GRPO step, the
  validation curve (when the run held sessions out) and the warm-start
  loss. Returns their file names."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  steps = [m["step"] for m in rl_metrics]
  names = []
  fig, ax = plt.subplots(figsize=(9, 4))
  colors = plt.cm.tab20.colors
  for i, term in enumerate(reward_terms(rl_metrics)):
    ax.plot(steps, [m.get(term) for m in rl_metrics], marker="o",
            color=colors[i % len(colors)], label=term.removeprefix("reward/"))
  ax.set(xlabel="GRPO step", ylabel="mean over rollouts",
         title="Reward terms per step")
  ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
  fig.tight_layout()
  fig.savefig(os.path.join(directory, "reward_terms.png"), dpi=120)
  names.append("reward_terms.png")
  panels = (("validity_rate", "validity rate"),
            ("response_tokens_mean", "response tokens (mean)"),
            ("kl", "KL to the reference (k3)"),
            ("reward_group_std", "within-group reward std"))
  fig, axes = plt.subplots(1, len(panels), figsize=(14, 3.2))
  for ax, (key, title) in zip(axes, panels):
    ax.plot(steps, [m.get(key) for m in rl_metrics], marker="o")
    ax.set(xlabel="GRPO step", title=title)
  fig.tight_layout()
  fig.savefig(os.path.join(directory, "rollout_stats.png"), dpi=120)
  names.append("rollout_stats.png")
  validated = [m for m in rl_metrics if "eval/reward" in m]
  if validated:  # The held-out sessions (`rl.validation_sessions`).
    fig, ax = plt.subplots(figsize=(6, 3.2))
    for key in ("eval/reward", "eval/qa", "eval/cmi"):
      ax.plot([m["step"] for m in validated], [m[key] for m in validated],
              marker="o", label=key.removeprefix("eval/"))
    ax.set(xlabel="GRPO step", ylabel="greedy, mean over sessions",
           title=f"Validation ({validated[-1]['eval/sessions']} held-out "
                 "sessions)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(directory, "validation.png"), dpi=120)
    names.append("validation.png")
  if sft_metrics:
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot([m["step"] for m in sft_metrics],
            [m["nll"] for m in sft_metrics], marker="o")
    ax.set(xlabel="warm-start step", ylabel="response-token NLL",
           title="Warm start")
    fig.tight_layout()
    fig.savefig(os.path.join(directory, "warm_start_loss.png"), dpi=120)
    names.append("warm_start_loss.png")
  plt.close("all")
  return names


def results_table(results: dict[str, dict]) -> str:
  """Markdown: per category, context recall and evidence-turn recall of
  each policy. The overall row follows the benchmark's protocol (LoCoMo:
  adversarial left out), so its `n` counts only the categories it means."""
  categories = sorted({c for r in results.values()
                       for c in r["by_category"]})
  header = "| category | n | " + " | ".join(
      f"{p} ctx recall | {p} evidence recall" for p in results) + " |"
  lines = [header, "|" + "---|" * (2 + 2 * len(results))]

  def cell(result, metric, category):
    block = result.get(metric) or {}
    value = (block.get("overall") if category is None
             else block.get("by_category", {}).get(category))
    return "—" if value is None else f"{value:.3f}"

  def row(label: str, n: int, category: str | None) -> str:
    return f"| {label} | {n} | " + " | ".join(
        f"{cell(r, 'context_recall', category)} | "
        f"{cell(r, 'evidence_recall', category)}"
        for r in results.values()) + " |"

  first = next(iter(results.values()))
  counts = first["n_by_category"]
  lines += [row(c, counts.get(c, 0), c) for c in categories]
  excluded = first.get("context_recall", {}).get("excluded_from_overall", [])
  label = ("overall" if not excluded
           else f"overall (without {', '.join(excluded)})")
  lines.append(row(label, sum(n for c, n in counts.items()
                              if c not in excluded), None))
  return "\n".join(lines)


def reproduce(config, workdir: str) -> str:
  """Runs (or resumes) every step; returns RESULTS.md's text."""
  os.makedirs(workdir, exist_ok=True)
  wall: dict[str, float] = {}
  repro = config.repro
  locomo = load_dataset("locomo", repro.locomo)
  teachers = locomo[_slice(repro.teacher_dialogues)]
  held_out = locomo[_slice(repro.eval_dialogues)]
  overlap = {d.dialogue_id for d in teachers} & {d.dialogue_id
                                                 for d in held_out}
  if overlap:
    raise ValueError(f"teacher and evaluation dialogues overlap: {overlap}")
  data = os.path.join(workdir, "sft_data.jsonl")
  if not os.path.exists(data):
    records, rejected = _timed(
        wall, "teacher data", annotation_trajectories, teachers,
        make_encoder(config.encoder), config.memory,
        config.rollout.retrieval_top_k)
    write_jsonl(data, records)
    print(json.dumps({"sft_records": len(records), "rejected": rejected}))
  config.sft.data = data
  sft_dir, rl_dir = (os.path.join(workdir, n) for n in ("sft", "rl"))
  _timed(wall, "warm start", run_sft, config, sft_dir)
  config.policy.init_checkpoint = sft_dir
  print(_timed(wall, "GRPO", train, config, rl_dir))
  evaluation = config.evaluation
  evaluation.dataset.update({
      "name": "locomo", "path": repro.locomo,
      "start": _slice(repro.eval_dialogues).start or 0,
      "dialogues": len(held_out)})
  results = {}
  for name, init in zip(POLICIES, ("", sft_dir, rl_dir)):
    evaluation.builder.init_checkpoint = init
    results[name] = _timed(wall, f"evaluate {name}", evaluate, evaluation,
                           os.path.join(workdir, "eval", name))
  rl_metrics, sft_metrics = read_metrics(rl_dir), read_metrics(sft_dir)
  plots = plot_training(rl_metrics, sft_metrics, workdir)
  last = rl_metrics[-1]
  text = "\n".join([
      "# Small reproduction (configs/small_repro.py)", "",
      "Command: `python tools/reproduce.py --config=configs/small_repro.py "
      f"--workdir={workdir}`", "",
      "## Split", "",
      f"- warm start (LoCoMo annotations as teacher): "
      f"{', '.join(d.dialogue_id for d in teachers)} "
      f"({len(read_lines(data))} trajectories)",
      "- GRPO: the bundled LongMemEval training sample (per-session QA)",
      f"- evaluation (never seen in training): "
      f"{', '.join(d.dialogue_id for d in held_out)}, `method=policy`, "
      "every bank built by the policy with grammar-constrained decoding, "
      "scored by `context_recall` and evidence-turn recall", "",
      "## Held-out scores per category", "",
      results_table(results), "",
      f"Questions: {results['initial']['n']} per policy. GRPO: "
      f"{last['step']} steps, last step validity "
      f"{last['validity_rate']:.2f}, reward {last['reward_mean']:.4f}.", "",
      "## Training curves", "",
      *[f"![{p}]({p})" for p in plots], "",
      "## Wall time (seconds, this machine)", "",
      "| step | s |", "|---|---|",
      *[f"| {k} | {v} |" for k, v in wall.items()], ""])
  with open(os.path.join(workdir, "RESULTS.md"), "w") as f:
    f.write(text)
  return text


def read_lines(path: str) -> list[str]:
  with open(path, encoding="utf-8") as f:
    return [line for line in f if line.strip()]


def main(argv: list[str]) -> None:
  del argv
  if not flags.FLAGS.workdir:
    raise app.UsageError("--workdir is required")
  print(reproduce(flags.FLAGS.config, flags.FLAGS.workdir))


if __name__ == "__main__":
  define_command_line_flags()
  app.run(main)
