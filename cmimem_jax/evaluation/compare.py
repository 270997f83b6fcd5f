"""Comparisons of evaluated policies and of scores, the analysis beside
`metrics.bootstrap_interval`: per-question paired differences with 95%
bootstrap intervals (one run, runs of several seeds pooled, one workdir
against another), their markdown tables, and rank statistics of a score
against a label (the Mann-Whitney AUC, Spearman's correlation).

`records` throughout: policy -> question id -> evaluation record (the
`predictions.jsonl` of `run.evaluate`, read by `run.read_records`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy.stats import rankdata

from cmimem_jax.evaluation.metrics import bootstrap_interval

# The recall metrics a memory is compared on; LoCoMo's adversarial
# questions are left out, as the overall figure does.
METRICS = ("context_recall", "evidence_recall")
EXCLUDED = ("adversarial",)


def question_pairs(records: dict[str, dict[str, dict]], policy: str,
                   baseline: str, metric: str, excluded: Sequence[str]
                   ) -> dict[str, tuple[float, float]]:
  """question id -> (policy's score, baseline's score) on the questions
  both scored, categories in `excluded` left out."""
  return {qid: (record[metric], records[baseline][qid][metric])
          for qid, record in records[policy].items()
          if record.get("category") not in excluded
          and record.get(metric) is not None
          and records[baseline].get(qid, {}).get(metric) is not None}


def paired_differences(records: dict[str, dict[str, dict]],
                       comparisons: Sequence[tuple[str, str]],
                       metrics: Sequence[str] = METRICS,
                       excluded: Sequence[str] = EXCLUDED,
                       seed: int = 0) -> list[dict]:
  """Each `(policy, baseline)` of `comparisons` both evaluated, on the
  questions both scored (categories in `excluded` left out): the mean
  per-question difference and its 95% paired bootstrap interval, a row
  per comparison and metric (`{"policy", "baseline", "metric", "n",
  "policy_mean", "baseline_mean", "difference", "ci95"}`)."""
  return seed_pooled_differences([records], comparisons, metrics, excluded,
                                 seed)


def seed_pooled_differences(runs: Sequence[dict[str, dict[str, dict]]],
                            comparisons: Sequence[tuple[str, str]],
                            metrics: Sequence[str] = METRICS,
                            excluded: Sequence[str] = EXCLUDED,
                            seed: int = 0) -> list[dict]:
  """`paired_differences` over runs of the same recipe with different
  seeds: per question, the difference averaged over the runs, and its 95%
  bootstrap interval over questions (questions every run scored). With
  few runs the interval reflects the questions' spread, not the seeds';
  `per_run` lists each run's own mean difference on the same questions.

  Args:
    runs: one `records` (policy -> question id -> record) per seed.
  """
  rng = np.random.default_rng(seed)
  rows = []
  for policy, baseline in comparisons:
    if any(policy not in r or baseline not in r for r in runs):
      continue
    for metric in metrics:
      pairs = [question_pairs(r, policy, baseline, metric, excluded)
               for r in runs]
      # In the first run's order: one run's intervals stay as they were.
      questions = [q for q in pairs[0] if all(q in p for p in pairs[1:])]
      if not questions:
        continue
      scores = np.array([[p[q] for q in questions] for p in pairs],
                        float)                       # [runs, Q, 2]
      ours, theirs = scores[..., 0].mean(0), scores[..., 1].mean(0)
      low, high = bootstrap_interval(ours - theirs, rng)
      row = {"policy": policy, "baseline": baseline, "metric": metric,
             "n": len(questions), "policy_mean": float(ours.mean()),
             "baseline_mean": float(theirs.mean()),
             "difference": float((ours - theirs).mean()),
             "ci95": [low, high]}
      if len(runs) > 1:
        row["per_run"] = [float(d) for d in
                          (scores[..., 0] - scores[..., 1]).mean(1)]
      rows.append(row)
  return rows


def workdir_differences(records: dict[str, dict[str, dict]],
                        other: dict[str, dict[str, dict]],
                        policies: Sequence[str],
                        metrics: Sequence[str] = METRICS,
                        excluded: Sequence[str] = EXCLUDED,
                        seed: int = 0) -> list[dict]:
  """Each of `policies` evaluated in both workdirs, this one (`records`)
  minus `other`, on the questions both scored: the mean per-question
  difference and its 95% paired bootstrap interval (rows as
  `paired_differences`', the policy its own baseline)."""
  rng = np.random.default_rng(seed)
  rows = []
  for policy in (p for p in policies if p in records and p in other):
    both = {"this": records[policy], "other": other[policy]}
    for metric in metrics:
      pairs = question_pairs(both, "this", "other", metric, excluded)
      if not pairs:
        continue
      scores = np.array(list(pairs.values()), float)       # [Q, 2]
      low, high = bootstrap_interval(scores[:, 0] - scores[:, 1], rng)
      rows.append({"policy": policy, "baseline": policy, "metric": metric,
                   "n": len(pairs), "policy_mean": float(scores[:, 0].mean()),
                   "baseline_mean": float(scores[:, 1].mean()),
                   "difference": float((scores[:, 0] - scores[:, 1]).mean()),
                   "ci95": [low, high]})
  return rows


def differences_table(rows: list[dict]) -> str:
  """Markdown of `paired_differences` rows: both means and the difference
  with its interval."""
  lines = ["| policy − baseline | metric | n | policy | baseline | "
           "difference [95% CI] |", "|---|---|---|---|---|---|"]
  for r in rows:
    low, high = r["ci95"]
    lines.append(f"| {r['policy']} − {r['baseline']} | {r['metric']} | "
                 f"{r['n']} | {r['policy_mean']:.3f} | "
                 f"{r['baseline_mean']:.3f} | {r['difference']:+.3f} "
                 f"[{low:+.3f}, {high:+.3f}] |")
  return "\n".join(lines)


def pooled_table(rows: list[dict]) -> str:
  """Markdown of `seed_pooled_differences` rows of several runs: each
  seed's difference and the pooled one with its interval."""
  lines = ["| policy − baseline | metric | n | difference per seed | "
           "seed-averaged difference [95% CI] |", "|---|---|---|---|---|"]
  for r in rows:
    low, high = r["ci95"]
    per_run = ", ".join(f"{d:+.3f}" for d in r["per_run"])
    lines.append(f"| {r['policy']} − {r['baseline']} | {r['metric']} | "
                 f"{r['n']} | {per_run} | {r['difference']:+.3f} "
                 f"[{low:+.3f}, {high:+.3f}] |")
  return "\n".join(lines)


def spearman(x: np.ndarray, y: np.ndarray) -> float:
  """Spearman's rank correlation of `x` and `y` `[n]` (nan if either side
  is constant)."""
  rx, ry = rankdata(x), rankdata(y)
  if rx.std() == 0 or ry.std() == 0:
    return float("nan")
  return float(np.corrcoef(rx, ry)[0, 1])


def auc(scores: np.ndarray, positive: np.ndarray) -> float:
  """P(score of a positive > score of a negative) of `scores` `[n]`
  labelled by `positive` `[n]`, ties half (the Mann-Whitney AUC); nan
  without both kinds."""
  positive = np.asarray(positive, bool)
  n_pos, n_neg = positive.sum(), (~positive).sum()
  if not n_pos or not n_neg:
    return float("nan")
  ranks = rankdata(scores)
  return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2)
               / (n_pos * n_neg))
