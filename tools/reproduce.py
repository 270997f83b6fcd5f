"""The small reproduction, end to end: warm start -> GRPO with the
CMI+QA reward and, from the same warm start with the same budget, with
the QA reward alone (alpha = 0) and the CMI reward alone (alpha = 1) ->
held-out evaluation of the initial, warm-started and the three RL
policies, with results tables (paired 95% bootstrap intervals over
questions) and plots.

  python -m tools.reproduce --config=configs/small_repro.py --workdir=DIR

Without `--stages` (or with `--stages=all`) and without `--reuse`,
`--pool`, `--sweep`, `--compare`, it runs the config's whole recipe
(`recipe_runs`): every stage in DIR; the GRPO arms again with each of
`repro.other_seeds` in `DIR/seed<s>` and at each of
`repro.other_learning_rates` in `DIR/lr<rate>` (per seed), all from DIR's
warm start; each seed's arms evaluated from the rate its validation curve
picks; `DIR/RESULTS.md` pooling the seeds. A rerun resumes it.

Stages (`--stages`, comma-separated, in this order; `evaluate` for
every evaluation) run in DIR alone. A finished stage is recorded in
`DIR/stages.json` and skipped on a rerun; an interrupted one resumes
from its checkpoints / written predictions, so a run can be spread over
several invocations:
- `teacher`: `DIR/sft_data.jsonl`, LoCoMo annotation trajectories of
  `repro.teacher_dialogues` (`tools/make_sft_data.py`'s teacher (a)).
- `warm_start`: `DIR/sft/` (`python -m cmimem_jax.sft`).
- `grpo`: `DIR/rl/`, GRPO from the warm start with the config's reward.
- `grpo_qa_only`: `DIR/rl_qa_only/`, the same with `reward.alpha = 0`
  (the QA-only arm of Tables 3 / 8 and Figure 4).
- `grpo_cmi_only`: `DIR/rl_cmi_only/`, the same with `reward.alpha = 1`
  (Table 3's "+CMI" row: CMI without an outcome anchor).
- `eval_initial`, `eval_warm_start`, `eval_rl`, `eval_rl_qa_only`,
  `eval_rl_cmi_only`: `DIR/eval/<policy>/`, `cmimem_jax.evaluate` with `method=policy` on
  `repro.eval_dialogues`.
- `eval_equal_budget`: `DIR/eval_budget/<policy>/`, every evaluated
  policy's banks (copied, never rebuilt) evaluated again with the
  LookupChunk budget capped at `repro.equal_budget_chars` for every
  policy alike: with the paper's 160,000 characters a bank whose entries
  point at every session hands every question the same large context,
  and context / evidence recall then measure context size, not memory.
  Not recorded as finished: a rerun evaluates the policies evaluated
  since.
- `report`: `DIR/RESULTS.md` (split, per-category table, paired
  differences with intervals, per dialogue and policy the distinct
  retrieved lists and mean context size with degenerate policies flagged,
  the same at the common budget, the arms side by side, every stage's
  wall time) and `DIR/*.png`, from whatever has been evaluated so far.

The recipe's parts by hand (what `recipe_runs` passes; earlier rounds'
commands in RESULTS.md are written this way): `--reuse=DIR` takes DIR's
teacher data, warm start and `initial` / `warm_start` evaluations (with
another `--config.seed`, only GRPO and its evaluations then vary);
`--sweep=DIR2,...` names workdirs whose arms ran at other
`--config.rl.learning_rate`s from this one's warm start: each arm is
evaluated from the rate its validation reward picks (at its best kept
step), and the report tabulates and plots each arm's validation reward
per rate (the evaluation dialogues play no part in the choice);
`--pool=DIR1,...` adds each seed's differences and their per-question
average (`DIR/pooled_differences.json`); `--compare=DIR2` pairs each
policy evaluated in both workdirs (two settings on the same split).
Every evaluation records the checkpoint it read
(`eval/<policy>/evaluated.json`).
"""

from __future__ import annotations

import copy
import functools
import json
import os
import shlex
import shutil
import sys
import time
from collections.abc import Sequence
from typing import NamedTuple

from absl import app, flags
import numpy as np

from cmimem_jax import storage
from cmimem_jax.config import (CONFIG_FILE, define_command_line_flags,
                               run_command)
from cmimem_jax.data import bundled_path, load_dataset
from cmimem_jax.data.files import write_atomic, write_figure, write_json
from cmimem_jax.encoders import EncoderConfig, make_encoder
from cmimem_jax.evaluation.compare import (differences_table,
                                           paired_differences, pooled_table,
                                           seed_pooled_differences,
                                           workdir_differences)
from cmimem_jax.evaluation.run import evaluate, read_records
from cmimem_jax.memory import MemoryBank
from cmimem_jax.memory.builder import MemoryConfig
from cmimem_jax.memory.types import ENTRY_TYPES
from cmimem_jax.rl import read_metrics
from cmimem_jax.sampling import (PolicyConfig, load_tokenizer,
                                 policy_tokenizer_path, token_budget)
from cmimem_jax.task.loop import train
from cmimem_jax.task.warm_start import (annotation_trajectories, run_sft,
                                        trimmed_count, write_jsonl)


class Policy(NamedTuple):
  """One evaluated policy: the training stage that makes it and its run
  directory under DIR (both "" for the untrained one), the label of its
  GRPO arm ("" for the others) and the arm's reward alpha (None: the
  config's)."""
  stage: str = ""
  run: str = ""
  arm: str = ""
  alpha: float | None = None


POLICIES = {"initial": Policy(),
            "warm_start": Policy("warm_start", "sft"),
            "rl": Policy("grpo", "rl", "CMI+QA"),
            "rl_qa_only": Policy("grpo_qa_only", "rl_qa_only", "QA only", 0.0),
            "rl_cmi_only": Policy("grpo_cmi_only", "rl_cmi_only", "CMI only",
                                  1.0)}
# The GRPO arms, all from the warm start.
ARMS = {name: policy for name, policy in POLICIES.items() if policy.arm}
EQUAL_BUDGET = "eval_equal_budget"
STAGES = ("teacher", *(p.stage for p in POLICIES.values() if p.stage),
          *(f"eval_{p}" for p in POLICIES), EQUAL_BUDGET, "report")
# Where `EQUAL_BUDGET` evaluates, under DIR.
EQUAL_BUDGET_DIR = "eval_budget"
# A policy retrieving one list for more than this share of a dialogue's
# questions, or fewer distinct lists than `DEGENERATE_LISTS` of its
# questions, answers most of them from the same few contexts: degenerate.
# (The second rule was added after round eight's CMI-alone arm read 3
# lists for conv-49's 196 questions, 46 % on one, and escaped the first.)
DEGENERATE_SHARE = 0.5
DEGENERATE_LISTS = 0.1
# What an evaluation directory records of the checkpoint it evaluated.
EVALUATED_FILE = "evaluated.json"
# Paired comparisons reported with intervals: (policy, baseline).
COMPARISONS = (("warm_start", "initial"), ("rl", "warm_start"),
               ("rl_qa_only", "warm_start"), ("rl_cmi_only", "warm_start"),
               ("rl", "rl_qa_only"), ("rl", "rl_cmi_only"))

# This tool's flags (its own: tools share flag names): --config,
# --workdir and these.
FLAGS = flags.FlagValues()
define_command_line_flags(flag_values=FLAGS)
flags.DEFINE_list("stages", ["all"], "Stages to run, in order: "
                  f"{', '.join(STAGES)}; `all`, or `evaluate` for the "
                  "evaluations.", flag_values=FLAGS)
flags.DEFINE_string("reuse", "", "A workdir of the same config whose "
                    "teacher data, warm start and initial / warm-start "
                    "evaluations this run takes over instead of recomputing "
                    "them: with another `--config.seed`, only GRPO and its "
                    "evaluations then vary (a recomputed warm start would "
                    "shuffle its data by the seed too).",
                    flag_values=FLAGS)
flags.DEFINE_list("pool", [], "Workdirs of the same config run with other "
                  "seeds (`--config.seed`): `report` adds the differences "
                  "per seed and averaged over the seeds.",
                  flag_values=FLAGS)
flags.DEFINE_string("compare", "", "A workdir run on the same split with "
                    "another setting (e.g. `--config.sft.trim_retrieved`): "
                    "`report` adds, for each policy both evaluated, the "
                    "paired differences this workdir minus that one.",
                    flag_values=FLAGS)
flags.DEFINE_list("sweep", [], "Workdirs whose GRPO arms ran from this "
                  "one's warm start (`--reuse`) with another "
                  "`--config.rl.learning_rate`: `report` adds each arm's "
                  "validation curve per learning rate and the rate the "
                  "validation picks (`sweep.md`, `sweep.png`).",
                  flag_values=FLAGS)


def _slice(text: str) -> slice:
  start, _, stop = text.partition(":")
  return slice(int(start) if start else None, int(stop) if stop else None)


def _pyplot():
  """matplotlib's pyplot on the file-only backend (no display needed)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


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
  plt = _pyplot()
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
  write_figure(fig, os.path.join(directory, "reward_terms.png"))
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
  write_figure(fig, os.path.join(directory, "rollout_stats.png"))
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
    write_figure(fig, os.path.join(directory, "validation.png"))
    names.append("validation.png")
  if sft_metrics:
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot([m["step"] for m in sft_metrics],
            [m["nll"] for m in sft_metrics], marker="o")
    ax.set(xlabel="warm-start step", ylabel="response-token NLL",
           title="Warm start")
    fig.tight_layout()
    write_figure(fig, os.path.join(directory, "warm_start_loss.png"))
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


def parse_stages(names: list[str]) -> list[str]:
  """The requested stages in pipeline order (`all`, `evaluate` expand).

  Raises:
    app.UsageError: on an unknown name.
  """
  wanted = set()
  for name in (n.strip() for n in names):
    if name == "all":
      wanted.update(STAGES)
    elif name == "evaluate":
      wanted.update(s for s in STAGES if s.startswith("eval_"))
    elif name in STAGES:
      wanted.add(name)
    else:
      raise app.UsageError(f"unknown stage {name!r}; stages: "
                           f"{', '.join(STAGES)}, all, evaluate")
  return [s for s in STAGES if s in wanted]


class StageRecord:
  """`DIR/stages.json`: the finished stages and their wall seconds."""

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, "stages.json")
    self.done: dict[str, float] = {}
    if os.path.exists(self.path):
      with open(self.path) as f:
        self.done = json.load(f)

  def finish(self, stage: str, seconds: float) -> None:
    self.done[stage] = round(seconds, 1)
    write_json(self.path, self.done)


# What the seed-independent stages leave in a workdir (`--reuse`): the
# teacher data, the warm start and the evaluations of the two policies
# that precede GRPO.
REUSABLE = {"teacher": "sft_data.jsonl", "warm_start": "sft",
            "eval_initial": os.path.join("eval", "initial"),
            "eval_warm_start": os.path.join("eval", "warm_start")}


def reuse_stages(workdir: str, source: str, record: StageRecord) -> None:
  """Takes `REUSABLE` stages that `source` (a workdir of the same config,
  e.g. another seed's) finished and this workdir has not: the warm start
  is linked (only read from here on), the rest copied; each is recorded
  with `source`'s wall seconds."""
  with open(os.path.join(source, "stages.json")) as f:
    finished = json.load(f)
  for stage, path in REUSABLE.items():
    if stage not in finished or stage in record.done:
      continue
    origin, target = os.path.join(source, path), os.path.join(workdir, path)
    if not os.path.exists(target):
      os.makedirs(os.path.dirname(target), exist_ok=True)
      if stage == "warm_start":
        os.symlink(os.path.abspath(origin), target)
      elif os.path.isdir(origin):
        shutil.copytree(origin, target)
      else:
        shutil.copy2(origin, target)
    record.finish(stage, finished[stage])
    print(f"{stage}: reused from {source} ({finished[stage]} s there)")


# The stage whose output a stage starts from.
NEEDS = {"warm_start": "teacher",
         **{arm.stage: "warm_start" for arm in ARMS.values()},
         **{f"eval_{name}": policy.stage for name, policy in POLICIES.items()
            if policy.stage}}


def arm_config(config, arm: Policy, warm_start_dir: str):
  """GRPO from the warm start; an arm with its own alpha (Eq. 12: the
  QA-only arm 0, the CMI-only arm 1) changes nothing else."""
  config = copy.deepcopy(config)
  config.policy.init_checkpoint = warm_start_dir
  if arm.alpha is not None:
    config.reward.alpha = arm.alpha
  return config


def _eval_dirs(workdir: str, under: str = "eval") -> dict[str, str]:
  """policy -> its evaluation directory under `workdir/under`."""
  return {p: os.path.join(workdir, under, p) for p in POLICIES}


def _evaluated_records(eval_dirs: dict[str, str]
                       ) -> dict[str, dict[str, dict]]:
  """policy -> question id -> record, for the policies evaluated."""
  return {policy: read_records(os.path.join(directory, "predictions.jsonl"))
          for policy, directory in eval_dirs.items()
          if os.path.exists(os.path.join(directory, "results.json"))}


def bank_sizes(directory: str) -> dict[str, int] | None:
  """Entries per memory type summed over the banks under `directory` (one
  folder per dialogue), and the core block's length in characters."""
  if not os.path.isdir(directory):
    return None
  sizes = {"core chars": 0, **{t.value.lower(): 0 for t in ENTRY_TYPES}}
  for name in sorted(os.listdir(directory)):
    bank = MemoryBank.load(os.path.join(directory, name))
    sizes["core chars"] += len(bank.core)
    for memory_type in ENTRY_TYPES:
      sizes[memory_type.value.lower()] += len(bank.entries(memory_type))
  return sizes


def _over_steps(metrics: list[dict], key: str) -> list[float]:
  return [float(m[key]) for m in metrics if m.get(key) is not None]


def arms_table(arms: dict[str, list[dict]], period: int) -> str:
  """The GRPO arms side by side (Table 8 / Figure 4's measures): rewards,
  response length and policy-gradient loss over the steps, KL and
  validation at the last, and the checkpoint evaluated (`chosen_step`)."""
  def mean_std(values: list[float]) -> str:
    return (f"{np.mean(values):.4f} ± {np.std(values):.4f}" if values
            else "—")

  def last(values: list[float]) -> str:
    return f"{values[-1]:.4f}" if values else "—"

  rows = [("steps", lambda m: str(len(m))),
          ("reward (mean ± std over steps)",
           lambda m: mean_std(_over_steps(m, "reward_mean"))),
          ("QA term", lambda m: mean_std(_over_steps(m, "reward/qa"))),
          ("CMI term", lambda m: mean_std(_over_steps(m, "reward/cmi"))),
          ("response tokens", lambda m: mean_std(
              _over_steps(m, "response_tokens_mean"))),
          ("policy-gradient loss", lambda m: mean_std(
              _over_steps(m, "pg_loss"))),
          # Issue 45: whether any Semantic SKIP is judged justified (the
          # second is logged only at steps with a SKIP).
          ("Semantic SKIP rate (rollouts)", lambda m: mean_std(
              _over_steps(m, "reward/semantic_skip"))),
          ("Semantic SKIPs judged justified", lambda m: mean_std(
              _over_steps(m, "reward/semantic_skip_justified"))),
          ("policy-gradient loss, absolute", lambda m: mean_std(
              [abs(v) for v in _over_steps(m, "pg_loss")])),
          ("validity (last step)", lambda m: last(
              _over_steps(m, "validity_rate"))),
          ("KL to the reference (last step)", lambda m: last(
              _over_steps(m, "kl"))),
          ("validation reward (last)", lambda m: last(
              _over_steps(m, "eval/reward"))),
          ("validation QA (last)", lambda m: last(_over_steps(m, "eval/qa"))),
          ("evaluated step (best validation reward)",
           lambda m: str(chosen_step(m, period) or "newest"))]
  lines = ["| measure | " + " | ".join(arms) + " |",
           "|---|" + "---|" * len(arms)]
  lines += [f"| {name} | " + " | ".join(cell(m) for m in arms.values())
            + " |" for name, cell in rows]
  return "\n".join(lines)


def bank_table(sizes: dict[str, dict[str, int]]) -> str:
  columns = list(next(iter(sizes.values())))
  lines = ["| policy | " + " | ".join(columns) + " |",
           "|---|" + "---|" * len(columns)]
  lines += [f"| {p} | " + " | ".join(str(s[c]) for c in columns) + " |"
            for p, s in sizes.items()]
  return "\n".join(lines)


def plot_arms(arms: dict[str, list[dict]], directory: str) -> str:
  """`arms.png`: the arms' per-step policy-gradient loss, response length,
  QA term and validation reward (what picks the evaluated checkpoint) on
  shared axes."""
  plt = _pyplot()
  panels = (("pg_loss", "policy-gradient loss"),
            ("response_tokens_mean", "response tokens (mean)"),
            ("reward/qa", "QA term (rollouts)"),
            ("eval/reward", "validation reward (greedy)"))
  fig, axes = plt.subplots(1, len(panels), figsize=(15, 3.3))
  for ax, (key, title) in zip(axes, panels):
    for label, metrics in arms.items():
      points = [(m["step"], m[key]) for m in metrics
                if m.get(key) is not None]
      if points:
        ax.plot(*zip(*points), marker="o", label=label)
    ax.set(xlabel="GRPO step", title=title)
  axes[0].axhline(0.0, color="grey", linewidth=0.8)
  axes[0].legend(fontsize=8)
  fig.tight_layout()
  write_figure(fig, os.path.join(directory, "arms.png"))
  plt.close(fig)
  return "arms.png"


# What picks an arm's evaluated checkpoint: its own reward on the
# validation sessions (greedy). (Their QA term alone is too coarse to
# rank steps: 2 sessions x 3 questions gave 0.833 at every step.)
SELECTION_KEY = "eval/reward"


def chosen_step(metrics: list[dict], period: int) -> int:
  """The kept step (a multiple of `period`) with the best validation
  reward, the latest among ties (equal greedy validation scores give no
  reason to stop early: round three's CMI+QA arm scored 0.2657 at steps
  2, 4 and 10); 0 (the newest checkpoint) without validation."""
  scored = [(m[SELECTION_KEY], m["step"]) for m in metrics
            if m.get(SELECTION_KEY) is not None and period
            and m["step"] % period == 0]
  if not scored:
    return 0
  return max(scored)[1]  # (value, step): the best value, then the latest.


def run_learning_rate(run_dir: str) -> float:
  """The GRPO learning rate a run was started with (its `config.json`)."""
  path = os.path.join(run_dir, CONFIG_FILE)
  if not os.path.exists(path):
    raise app.UsageError(f"--sweep: {run_dir} has no {CONFIG_FILE} (a run "
                         "of this tool writes one)")
  with open(path) as f:
    return float(json.load(f)["rl"]["learning_rate"])


def learning_rate_sweep(runs: dict[float, dict[str, list[dict]]],
                        period: int) -> list[dict]:
  """Per arm and learning rate, the validation curve at the kept steps
  and its best point (`chosen_step`'s rule); `chosen` marks each arm's
  rate with the best one (the larger among ties: it moved further).

  Args:
    runs: learning rate -> arm label -> that run's metrics.
  """
  rows = []
  for arm in ARMS.values():
    curves = {}
    for rate, arms in sorted(runs.items()):
      step = chosen_step(arms.get(arm.arm, []), period)
      if step:
        curve = {m["step"]: float(m[SELECTION_KEY]) for m in arms[arm.arm]
                 if m.get(SELECTION_KEY) is not None
                 and m["step"] % period == 0}
        curves[rate] = (curve, step)
    if not curves:
      continue
    best = max(curves, key=lambda r: (curves[r][0][curves[r][1]], r))
    rows += [{"arm": arm.arm, "learning_rate": rate, "curve": curve,
              "best_step": step, "best": curve[step], "chosen": rate == best}
             for rate, (curve, step) in curves.items()]
  return rows


def sweep_table(rows: list[dict]) -> str:
  steps = sorted({s for r in rows for s in r["curve"]})
  lines = ["| arm | learning rate | " + " | ".join(
      f"step {s}" for s in steps) + " | best (step) |",
           "|---|---|" + "---|" * (len(steps) + 1)]
  for r in rows:
    mark = "**" if r["chosen"] else ""
    cells = [f"{r['curve'][s]:.4f}" if s in r["curve"] else "—"
             for s in steps]
    lines.append(f"| {r['arm']} | {mark}{r['learning_rate']:g}{mark} | "
                 + " | ".join(cells) + f" | {mark}{r['best']:.4f} "
                 f"({r['best_step']}){mark} |")
  return "\n".join(lines)


def plot_sweep(rows: list[dict], directory: str) -> str:
  """`sweep.png`: each arm's validation reward per learning rate."""
  plt = _pyplot()
  arms = list(dict.fromkeys(r["arm"] for r in rows))
  fig, axes = plt.subplots(1, len(arms), figsize=(5 * len(arms), 3.3),
                           squeeze=False)
  for ax, arm in zip(axes[0], arms):
    for r in rows:
      if r["arm"] == arm:
        steps = sorted(r["curve"])
        ax.plot(steps, [r["curve"][s] for s in steps], marker="o",
                label=f"lr {r['learning_rate']:g}" + (
                    " (picked)" if r["chosen"] else ""))
    ax.set(xlabel="GRPO step", title=f"{arm}: validation reward (greedy)")
    ax.legend(fontsize=8)
  fig.tight_layout()
  write_figure(fig, os.path.join(directory, "sweep.png"))
  plt.close(fig)
  return "sweep.png"


def _eval_config(config, init_checkpoint: str, checkpoint_step: int,
                 start: int, dialogues: int, chunk_budget: int | None = None):
  """The evaluation job of a policy; `chunk_budget`: LookupChunk's
  characters instead of the config's."""
  evaluation = copy.deepcopy(config.evaluation)
  evaluation.dataset.update({"name": "locomo", "path": config.repro.locomo,
                             "start": start, "dialogues": dialogues})
  evaluation.builder.update({"init_checkpoint": init_checkpoint,
                             "checkpoint_step": checkpoint_step})
  if chunk_budget is not None:
    evaluation.memory.chunk_budget_chars = chunk_budget
  return evaluation


def retrieval_rows(records: dict[str, dict[str, dict]]) -> list[dict]:
  """Per policy and dialogue: questions, distinct retrieved lists (the
  ranked entry ids of each question's context), the share of questions
  given the most common one, the mean context size in characters (None
  for records from before it was recorded) and whether the policy is
  degenerate there (one list for more than `DEGENERATE_SHARE` of the
  questions, or fewer distinct lists than `DEGENERATE_LISTS` of them).

  Args:
    records: policy -> question id -> evaluation record.
  """
  rows = []
  for policy, by_question in records.items():
    dialogues: dict[str, list[dict]] = {}
    for record in by_question.values():
      dialogues.setdefault(record.get("dialogue_id", "?"), []).append(record)
    for dialogue, group in sorted(dialogues.items()):
      lists = [tuple(r.get("retrieved", ())) for r in group]
      top = max(lists.count(x) for x in set(lists)) / len(lists)
      sizes = [r["context_chars"] for r in group if "context_chars" in r]
      rows.append({"policy": policy, "dialogue": dialogue,
                   "questions": len(group), "distinct_lists": len(set(lists)),
                   "top_list_share": top,
                   "mean_context_chars": (float(np.mean(sizes)) if sizes
                                          else None),
                   "degenerate": (top > DEGENERATE_SHARE or len(set(lists))
                                  < DEGENERATE_LISTS * len(lists))})
  return rows


def retrieval_table(rows: list[dict]) -> str:
  lines = ["| policy | dialogue | questions | distinct retrieved lists | "
           "questions on the most common list | mean context (chars) | "
           "degenerate |", "|---|---|---|---|---|---|---|"]
  for r in rows:
    size = ("—" if r["mean_context_chars"] is None
            else f"{r['mean_context_chars']:,.0f}")
    lines.append(f"| {r['policy']} | {r['dialogue']} | {r['questions']} | "
                 f"{r['distinct_lists']} | {r['top_list_share']:.0%} | "
                 f"{size} | {'**yes**' if r['degenerate'] else 'no'} |")
  return "\n".join(lines)


def retrieval_section(records: dict[str, dict[str, dict]], title: str
                      ) -> list[str]:
  """RESULTS.md lines: `retrieval_table` and a warning naming each
  degenerate (policy, dialogue)."""
  rows = retrieval_rows(records)
  if not rows:
    return []
  lines = [f"### Retrieval per dialogue{title}", "", retrieval_table(rows), ""]
  degenerate = [f"{r['policy']} on {r['dialogue']}" for r in rows
                if r["degenerate"]]
  if degenerate:
    lines += [f"**Degenerate** (one retrieved list for more than "
              f"{DEGENERATE_SHARE:.0%} of the questions, or fewer distinct "
              f"lists than {DEGENERATE_LISTS:.0%} of them: most questions "
              "read the same few contexts, so recall there measures their "
              "size, not the memory): "
              f"{', '.join(degenerate)}.", ""]
  return lines


def reproduce(config, workdir: str, stages: Sequence[str] = STAGES,
              pool: Sequence[str] = (), reuse: str = "",
              command: str = "", sweep: Sequence[str] = (),
              compare: str = "") -> str | None:
  """Runs (or resumes) `stages`; returns RESULTS.md's text when `report`
  is one of them (pooling the evaluations of the workdirs in `pool`,
  the same recipe with other seeds). `reuse`: a workdir whose finished
  seed-independent stages (`REUSABLE`) this one takes over. `command`:
  the command line, quoted in the report (its config overrides say
  what ran). `sweep`: workdirs whose arms ran with other learning rates,
  reported with this one's on the validation curve; each arm is
  evaluated from the rate that curve picks. `compare`: a workdir
  of the same split and another setting, its evaluations paired with
  this one's."""
  os.makedirs(workdir, exist_ok=True)
  record = StageRecord(workdir)
  if reuse:
    reuse_stages(workdir, reuse, record)
  repro = config.repro
  locomo = load_dataset("locomo", repro.locomo)
  teachers = locomo[_slice(repro.teacher_dialogues)]
  held_out = locomo[_slice(repro.eval_dialogues)]
  overlap = {d.dialogue_id for d in teachers} & {d.dialogue_id
                                                 for d in held_out}
  if overlap:
    raise ValueError(f"teacher and evaluation dialogues overlap: {overlap}")
  data = os.path.join(workdir, "sft_data.jsonl")
  config.sft.data = data
  model_dirs = {name: os.path.join(workdir, policy.run) if policy.run else ""
                for name, policy in POLICIES.items()}
  sft_dir = model_dirs["warm_start"]
  eval_dirs = _eval_dirs(workdir)

  def teacher() -> None:
    top_k = config.rollout.retrieval_top_k
    policy = PolicyConfig.from_config(config.policy)
    fits = (token_budget(load_tokenizer(policy_tokenizer_path(policy)),
                         config.sft.max_prompt_tokens)
            if config.sft.trim_retrieved else None)
    records, rejected = annotation_trajectories(
        teachers, make_encoder(EncoderConfig.from_config(config.encoder)),
        MemoryConfig.from_config(config.memory), top_k, fits)
    write_jsonl(data, records)
    print(json.dumps({"sft_records": len(records), "rejected": rejected,
                      "trimmed": trimmed_count(records, top_k)}))

  def warm_start() -> None:
    # GRPO starts from the warm start's newest checkpoint; kept steps
    # (`checkpoint.keep_period`, 1.6 GB each here) are for picking a GRPO
    # checkpoint on the validation curve.
    sft_config = copy.deepcopy(config)
    sft_config.checkpoint.keep_period = 0
    run_sft(sft_config, sft_dir)

  runs = {"teacher": teacher, "warm_start": warm_start}
  for name, arm in ARMS.items():
    runs[arm.stage] = functools.partial(
        lambda a, d: print(train(arm_config(config, a, sft_dir), d)),
        arm, model_dirs[name])
  start_index = _slice(repro.eval_dialogues).start or 0
  period = config.checkpoint.keep_period
  swept = (swept_workdirs(workdir, config.rl.learning_rate, sweep)
           if sweep else {})

  def evaluated_dirs() -> dict[str, str]:
    # The runs evaluated and reported: with a sweep, each arm's is the one
    # of the learning rate its validation curve picks (read when needed:
    # GRPO may have run earlier in this invocation).
    return {**model_dirs, **picked_runs(sweep_rows(swept, period), swept)}

  def evaluate_policy(policy: str) -> None:
    run = evaluated_dirs()[policy]
    step = chosen_step(read_metrics(run), period) if policy in ARMS else 0
    print(f"{policy}: evaluating {run or 'the initial policy'}, checkpoint "
          f"step {step or 'newest'}")
    evaluate(_eval_config(config, run, step, start_index, len(held_out)),
             eval_dirs[policy])
    write_json(os.path.join(eval_dirs[policy], EVALUATED_FILE),
               {"run": run, "step": step})

  for policy in POLICIES:
    runs[f"eval_{policy}"] = functools.partial(evaluate_policy, policy)
  budget_dirs = _eval_dirs(workdir, EQUAL_BUDGET_DIR)

  def evaluate_at_equal_budget() -> None:
    for policy, directory in eval_dirs.items():
      target = budget_dirs[policy]
      if os.path.exists(os.path.join(target, "results.json")) or not (
          os.path.exists(os.path.join(directory, "results.json"))):
        continue
      if not os.path.exists(os.path.join(directory, EVALUATED_FILE)):
        print(f"{policy}: its evaluation records no checkpoint "
              f"({EVALUATED_FILE}): not evaluated at the common budget")
        continue
      with open(os.path.join(directory, EVALUATED_FILE)) as f:
        evaluated = json.load(f)
      banks = os.path.join(directory, "banks")
      if os.path.isdir(banks) and not os.path.exists(
          os.path.join(target, "banks")):
        shutil.copytree(banks, os.path.join(target, "banks"))
      print(f"{policy}: evaluating its banks with LookupChunk capped at "
            f"{repro.equal_budget_chars:,} characters", flush=True)
      evaluate(_eval_config(config, evaluated["run"], evaluated["step"],
                            start_index, len(held_out),
                            repro.equal_budget_chars), target)

  def finished(stage: str) -> dict[str, float]:
    # An arm's evaluation reads the run its sweep picked, which may live in
    # a swept workdir: the stage it needs is finished there.
    policy = stage.removeprefix("eval_")
    if stage.startswith("eval_") and policy in ARMS:
      return StageRecord(os.path.dirname(evaluated_dirs()[policy])).done
    return record.done

  text = None
  for stage in stages:
    if stage == EQUAL_BUDGET:
      evaluate_at_equal_budget()
      continue
    if stage == "report":
      text = report(workdir, teachers, held_out, record.done, eval_dirs,
                    evaluated_dirs(), period, pool, command,
                    config.dataset.path)
      if compare:
        text += compare_report(workdir, compare, eval_dirs)
      if sweep:
        text += sweep_report(workdir, swept, sweep_rows(swept, period))
      write_atomic(os.path.join(workdir, "RESULTS.md"), text)
      continue
    if stage in record.done:
      print(f"{stage}: finished in an earlier run "
            f"({record.done[stage]} s), skipped")
      continue
    needed = NEEDS.get(stage)
    if needed and needed not in finished(stage):
      raise app.UsageError(f"stage {stage} starts from stage {needed}'s "
                           f"output: run --stages={needed} first")
    print(f"{stage}: running", flush=True)
    start = time.perf_counter()
    runs[stage]()
    record.finish(stage, time.perf_counter() - start)
  return text


class Run(NamedTuple):
  """One `reproduce` call of the recipe: its workdir, the config fields it
  changes (`seed`, `rl.learning_rate`), its stages and the workdirs it
  reuses, sweeps and pools (as `--reuse`, `--sweep`, `--pool`)."""
  workdir: str
  seed: int
  learning_rate: float
  stages: tuple[str, ...]
  reuse: str = ""
  sweep: tuple[str, ...] = ()
  pool: tuple[str, ...] = ()


GRPO_STAGES = tuple(arm.stage for arm in ARMS.values())


def recipe_runs(config, workdir: str) -> list[Run]:
  """The whole recipe as `reproduce` calls, in order: the seed-independent
  stages and every arm in `workdir` (`seed`, `rl.learning_rate`); the arms
  again at each of `repro.other_learning_rates` (`workdir/lr<rate>`) and
  with each of `repro.other_seeds` (`workdir/seed<s>`, its rates in
  `workdir/seed<s>/lr<rate>`), all from `workdir`'s warm start; each
  seed's evaluations of the arms from the rate its own validation curve
  picks; the report in `workdir`, pooling the other seeds."""
  repro = config.repro
  rates = [float(r) for r in repro.other_learning_rates]
  seeds = [int(s) for s in repro.other_seeds]
  if config.rl.learning_rate in rates or config.seed in seeds or len(
      set(rates)) < len(rates) or len(set(seeds)) < len(seeds):
    raise app.UsageError(
        "repro.other_learning_rates / other_seeds list rates and seeds "
        f"besides rl.learning_rate ({config.rl.learning_rate:g}) and seed "
        f"({config.seed}), each once: {rates} / {seeds}")
  evaluations = tuple(s for s in STAGES if s.startswith("eval_")
                      and s != EQUAL_BUDGET)
  runs, seed_dirs, sweeps = [], [], []
  for seed in [config.seed, *seeds]:
    base = workdir if seed == config.seed else os.path.join(
        workdir, f"seed{seed}")
    reuse = "" if base == workdir else workdir
    swept = tuple(os.path.join(base, f"lr{rate:g}") for rate in rates)
    first = ("teacher", "warm_start") if base == workdir else ()
    runs.append(Run(base, seed, config.rl.learning_rate,
                    (*first, *GRPO_STAGES), reuse))
    runs += [Run(directory, seed, rate, GRPO_STAGES, workdir)
             for directory, rate in zip(swept, rates)]
    runs.append(Run(base, seed, config.rl.learning_rate,
                    (*evaluations, EQUAL_BUDGET, "report"), reuse, swept))
    seed_dirs.append(base)
    sweeps.append(swept)
  if seeds:  # The first seed's report again, now pooling the others'.
    runs.append(Run(workdir, config.seed, config.rl.learning_rate,
                    ("report",), sweep=sweeps[0], pool=tuple(seed_dirs[1:])))
  return runs


def run_recipe(config, workdir: str, command: str) -> str | None:
  """Runs (or resumes: finished stages are skipped) `recipe_runs`;
  returns the last report's text."""
  text = None
  for run in recipe_runs(config, workdir):
    run_config = copy.deepcopy(config)
    run_config.seed = run.seed
    run_config.rl.learning_rate = run.learning_rate
    print(f"recipe: {run.workdir} (seed {run.seed}, learning rate "
          f"{run.learning_rate:g}): {', '.join(run.stages)}", flush=True)
    text = reproduce(run_config, run.workdir, run.stages, run.pool,
                     run.reuse, f"{command}  # {run.workdir}: seed "
                     f"{run.seed}, rl.learning_rate {run.learning_rate:g}",
                     run.sweep) or text
  return text


def _run_metrics(directory: str) -> list[dict]:
  """A training run's `metrics.jsonl` records ([] before it has run)."""
  if os.path.exists(os.path.join(directory, "metrics.jsonl")):
    return read_metrics(directory)
  return []


def evaluated_checkpoints(eval_dirs: dict[str, str]) -> str:
  """"policy: run step N, ..." from each evaluation's `EVALUATED_FILE`
  (an evaluation from before it was written says "not recorded")."""
  parts = []
  for policy, directory in eval_dirs.items():
    if not os.path.exists(os.path.join(directory, "results.json")):
      continue
    path = os.path.join(directory, EVALUATED_FILE)
    if not os.path.exists(path):
      parts.append(f"{policy}: not recorded")
      continue
    with open(path) as f:
      evaluated = json.load(f)
    parts.append(f"{policy}: " + (
        f"`{evaluated['run']}` step {evaluated['step'] or 'newest'}"
        if evaluated["run"] else "the untrained policy"))
  return "; ".join(parts)


def report(workdir: str, teachers, held_out, wall: dict[str, float],
           eval_dirs: dict[str, str], model_dirs: dict[str, str],
           period: int, pool: Sequence[str] = (), command: str = "",
           training_data: str = "") -> str:
  """RESULTS.md's text (and the plots) from what has been run so far;
  `training_data`: GRPO's dataset file (default: the bundled sample);
  `model_dirs`: policy -> the run directory evaluated and reported;
  `pool`: workdirs of the same recipe run with other seeds, pooled with
  this one; `command`: the invocation writing it (default: the bare
  recipe)."""
  results, banks = {}, {}
  for policy, directory in eval_dirs.items():
    path = os.path.join(directory, "results.json")
    if os.path.exists(path):
      with open(path) as f:
        results[policy] = json.load(f)
      banks[policy] = bank_sizes(os.path.join(directory, "banks", "policy"))
  records = _evaluated_records(eval_dirs)
  arms = {arm.arm: metrics for name, arm in ARMS.items()
          if (metrics := _run_metrics(model_dirs[name]))}
  sft_metrics = _run_metrics(model_dirs["warm_start"])
  plots = []
  if "CMI+QA" in arms:
    plots += plot_training(arms["CMI+QA"], sft_metrics, workdir)
  if arms:
    plots.append(plot_arms(arms, workdir))
  differences = paired_differences(records, COMPARISONS)
  write_json(os.path.join(workdir, "differences.json"), differences)
  data = os.path.join(workdir, "sft_data.jsonl")
  lines = [
      "# Small reproduction (configs/small_repro.py)", "",
      ("Command (the invocation that wrote this report): "
       f"`{command}`" if command else
       "Command: `python -m tools.reproduce --config=configs/small_repro.py "
       f"--workdir={workdir}`"), "",
      "## Split", "",
      f"- warm start (LoCoMo annotations as teacher): "
      f"{', '.join(d.dialogue_id for d in teachers)} "
      f"({len(read_lines(data)) if os.path.exists(data) else 0} "
      "trajectories)",
      "- GRPO (every arm): "
      + (f"`{os.path.basename(training_data)}`"
         if training_data and os.path.abspath(training_data) != bundled_path()
         else "the bundled LongMemEval training sample")
      + " (per-session QA)",
      f"- evaluation (never seen in training): "
      f"{', '.join(d.dialogue_id for d in held_out)}, `method=policy`, "
      "every bank built by the policy with grammar-constrained decoding, "
      "scored by `context_recall` and evidence-turn recall", "",
      "## Held-out scores per category", ""]
  if results:
    lines += [results_table(results), "",
              f"Questions: {next(iter(results.values()))['n']} per policy "
              f"({', '.join(results)} evaluated). Checkpoints evaluated: "
              f"{evaluated_checkpoints(eval_dirs)}.", "",
              "## Paired differences (95% bootstrap intervals over "
              "questions, adversarial left out)", "",
              differences_table(differences), "",
              *retrieval_section(records, " (the paper's LookupChunk "
                                 "budget)")]
    lines += equal_budget_section(workdir)
  else:
    lines += ["No policy evaluated yet (`--stages=evaluate,report`).", ""]
  if pool:
    runs = [records] + [_evaluated_records(_eval_dirs(other))
                        for other in pool]
    pooled = seed_pooled_differences(runs, COMPARISONS)
    write_json(os.path.join(workdir, "pooled_differences.json"),
               {"workdirs": [workdir, *pool], "rows": pooled})
    lines += [f"## Seeds pooled ({len(runs)} runs: this one, "
              f"{', '.join(pool)})", "",
              "Per question, the difference averaged over the runs; the "
              "interval is over questions (every run's), so with this few "
              "runs it does not measure the spread between seeds: compare "
              "the per-seed column.", "", pooled_table(pooled), ""]
  if arms:
    lines += ["## The GRPO arms (same warm start, same budget)", "",
              arms_table(arms, period), ""]
  sized = {p: s for p, s in banks.items() if s is not None}
  if sized:
    lines += ["## Held-out banks per memory type (summed over the "
              "evaluation dialogues)", "", bank_table(sized), ""]
  lines += ["## Training curves", "", *[f"![{p}]({p})" for p in plots], "",
            "## Wall time (seconds, this machine)", "",
            "| stage | s |", "|---|---|",
            *[f"| {k} | {v} |" for k, v in wall.items()], ""]
  # Ends in a blank line: the sweep / compare sections follow it.
  return "\n".join(lines) + "\n"


def equal_budget_section(workdir: str) -> list[str]:
  """RESULTS.md lines for the `EQUAL_BUDGET` evaluations: the per-category
  table, the paired differences and the retrieval per dialogue, every
  policy's contexts capped alike (also `differences_equal_budget.json`)."""
  eval_dirs = _eval_dirs(workdir, EQUAL_BUDGET_DIR)
  results = {}
  for policy, directory in eval_dirs.items():
    path = os.path.join(directory, "results.json")
    if os.path.exists(path):
      with open(path) as f:
        results[policy] = json.load(f)
  if not results:
    return []
  with open(os.path.join(eval_dirs[next(iter(results))],
                         "settings.json")) as f:
    budget = json.load(f)["memory"]["chunk_budget_chars"]
  records = _evaluated_records(eval_dirs)
  differences = paired_differences(records, COMPARISONS)
  write_json(os.path.join(workdir, "differences_equal_budget.json"),
             differences)
  return [f"## At a common LookupChunk budget ({budget:,} characters for "
          "every policy; the same banks)", "", results_table(results), "",
          differences_table(differences), "",
          *retrieval_section(records, f" ({budget:,} characters)")]


def compare_report(workdir: str, other: str, eval_dirs: dict[str, str]
                   ) -> str:
  """RESULTS.md's section pairing this workdir's evaluations with those
  of `other` (also `compared.json`)."""
  rows = workdir_differences(_evaluated_records(eval_dirs),
                             _evaluated_records(_eval_dirs(other)),
                             list(POLICIES))
  write_json(os.path.join(workdir, "compared.json"),
             {"workdirs": [workdir, other], "rows": rows})
  names = [os.path.basename(os.path.normpath(d)) for d in (workdir, other)]
  labelled = [dict(r, policy=f"{r['policy']} ({names[0]})",
                   baseline=f"{r['baseline']} ({names[1]})") for r in rows]
  return "\n".join([
      f"## This workdir − {other} (same split, another setting; 95% "
      "bootstrap intervals over questions, adversarial left out)", "",
      differences_table(labelled) if rows else
      "No policy evaluated in both workdirs.", "", ""])


def swept_workdirs(workdir: str, learning_rate: float,
                   sweep: Sequence[str]) -> dict[float, str]:
  """learning rate -> workdir: this one's (`learning_rate`, the config's)
  and each of `sweep`'s (read from its arms' `config.json`).

  Raises:
    app.UsageError: a swept workdir whose arms say no rate, two rates, or
      one already in the sweep.
  """
  workdirs = {learning_rate: workdir}
  for directory in sweep:
    rates = {run_learning_rate(os.path.join(directory, arm.run))
             for arm in ARMS.values()
             if os.path.isdir(os.path.join(directory, arm.run))}
    if len(rates) != 1 or rates & set(workdirs):
      raise app.UsageError(f"--sweep: {directory}'s arms ran with "
                           f"learning rates {sorted(rates)}; each swept "
                           "workdir needs one, not already in the sweep "
                           f"({sorted(workdirs)})")
    workdirs[rates.pop()] = directory
  return workdirs


def sweep_rows(workdirs: dict[float, str], period: int) -> list[dict]:
  """`learning_rate_sweep` over the arms run in `workdirs` (rate ->
  workdir)."""
  return learning_rate_sweep(
      {rate: {arm.arm: metrics for arm in ARMS.values() if (
          metrics := _run_metrics(os.path.join(directory, arm.run)))}
       for rate, directory in workdirs.items()}, period)


def picked_runs(rows: list[dict], workdirs: dict[float, str]
                ) -> dict[str, str]:
  """Policy name -> the run directory of the learning rate the validation
  picked for that arm (`rows`: `learning_rate_sweep`'s)."""
  picked = {r["arm"]: workdirs[r["learning_rate"]] for r in rows
            if r["chosen"]}
  return {name: os.path.join(picked[arm.arm], arm.run)
          for name, arm in ARMS.items() if arm.arm in picked}


def sweep_report(workdir: str, workdirs: dict[float, str],
                 rows: list[dict]) -> str:
  """RESULTS.md's learning-rate section (also `sweep.md`, `sweep.json`,
  `sweep.png`): each arm's validation curve per rate (`rows` from
  `sweep_rows(workdirs)`; `workdirs[rate]` is `workdir` for the config's
  rate)."""
  write_json(os.path.join(workdir, "sweep.json"),
             {"workdirs": list(workdirs.values()), "rows": rows})
  picked = ", ".join(f"{r['arm']} {r['learning_rate']:g}" for r in rows
                     if r["chosen"])
  own = next(rate for rate, d in workdirs.items() if d == workdir)
  swept = [d for d in workdirs.values() if d != workdir]
  lines = ["## GRPO learning rate on the validation curve", "",
           f"The arms' validation reward (held-out training sessions, "
           f"greedy; the evaluation dialogues play no part) per learning "
           f"rate, at the kept steps; this run's rate: {own:g}; "
           f"swept: {', '.join(swept)}. Picked (bold, the best validation "
           f"reward at any kept step): {picked}; `eval_rl` and "
           f"`eval_rl_qa_only` run with `--sweep` evaluate these.", "",
           sweep_table(rows), "", f"![sweep]({plot_sweep(rows, workdir)})",
           ""]
  text = "\n".join(lines)
  write_atomic(os.path.join(workdir, "sweep.md"), text)
  return text


def read_lines(path: str) -> list[str]:
  with open(path, encoding="utf-8") as f:
    return [line for line in f if line.strip()]


def main(argv: list[str]) -> None:
  del argv
  if not FLAGS.workdir:
    raise app.UsageError("--workdir is required")
  if any(storage.is_remote(d) for d in [FLAGS.workdir,
                                        *FLAGS.pool, *FLAGS.sweep,
                                        FLAGS.reuse,
                                        FLAGS.compare]):
    raise app.UsageError("tools.reproduce keeps its workdirs on local "
                         "disk (it links stage outputs between them); "
                         "python -m cmimem_jax.train / evaluate take "
                         "--workdir=gs://...")
  missing = [d for d in [*FLAGS.pool, *FLAGS.sweep,
                         FLAGS.reuse, FLAGS.compare]
             if d and not os.path.isfile(os.path.join(d, "stages.json"))]
  if missing:
    raise app.UsageError(f"--pool / --reuse: not a workdir of this tool "
                         f"(no stages.json): {', '.join(missing)}")
  command = shlex.join(["python", "-m", "tools.reproduce", *sys.argv[1:]])
  if FLAGS.stages == ["all"] and not any([FLAGS.pool, FLAGS.sweep,
                                          FLAGS.reuse, FLAGS.compare]):
    text = run_recipe(FLAGS.config, FLAGS.workdir, command)
  else:
    text = reproduce(FLAGS.config, FLAGS.workdir,
                     parse_stages(FLAGS.stages), FLAGS.pool, FLAGS.reuse,
                     command, FLAGS.sweep, FLAGS.compare)
  if text is not None:
    print(text)


if __name__ == "__main__":
  run_command(main, flag_values=FLAGS)
