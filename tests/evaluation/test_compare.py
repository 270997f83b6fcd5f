"""`evaluation.compare`: paired and seed-pooled differences with bootstrap
intervals, their tables, and the rank statistics (AUC, Spearman)."""

import numpy as np
import pytest

from cmimem_jax.evaluation.compare import (auc, differences_table,
                                           paired_differences, pooled_table,
                                           seed_pooled_differences, spearman,
                                           workdir_differences)

# The small reproduction's comparisons (`tools/reproduce.py`), in its order.
COMPARISONS = (("warm_start", "initial"), ("rl", "warm_start"),
               ("rl_qa_only", "warm_start"), ("rl_cmi_only", "warm_start"),
               ("rl", "rl_qa_only"), ("rl", "rl_cmi_only"))


def _records(scores: dict[str, tuple[str, float | None]]) -> dict:
  return {qid: {"question_id": qid, "category": category,
                "context_recall": value, "evidence_recall": None}
          for qid, (category, value) in scores.items()}


def test_paired_differences_pair_questions_and_leave_adversarial_out():
  base = _records({"a": ("single-hop", 0.0), "b": ("temporal", 0.5),
                   "c": ("adversarial", 0.0), "d": ("single-hop", 1.0),
                   "e": ("temporal", None)})
  better = _records({"a": ("single-hop", 1.0), "b": ("temporal", 1.0),
                     "c": ("adversarial", 1.0), "d": ("single-hop", 1.0),
                     "e": ("temporal", 1.0)})
  rows = paired_differences({"warm_start": base, "rl": better,
                              "initial": base}, COMPARISONS)
  # rl vs warm_start, warm_start vs initial; no QA-only arm evaluated;
  # evidence recall is None everywhere: no row.
  assert [(r["policy"], r["baseline"]) for r in rows] == [
      ("warm_start", "initial"), ("rl", "warm_start")]
  same, gain = rows
  assert same["difference"] == 0.0 and same["ci95"] == [0.0, 0.0]
  # a, b, d: adversarial c and unscored e are out.
  assert gain["n"] == 3
  assert gain["difference"] == pytest.approx((1.0 + 0.5 + 0.0) / 3)
  # Table 3's CMI-only arm, once evaluated: against the warm start, and
  # CMI+QA against it.
  with_cmi_only = paired_differences(
      {"warm_start": base, "rl": better, "rl_cmi_only": base}, COMPARISONS)
  assert [(r["policy"], r["baseline"], r["difference"])
          for r in with_cmi_only] == [
      ("rl", "warm_start", gain["difference"]),
      ("rl_cmi_only", "warm_start", 0.0),
      ("rl", "rl_cmi_only", gain["difference"])]
  assert gain["policy_mean"] == 1.0 and gain["baseline_mean"] == 0.5
  low, high = gain["ci95"]
  assert 0.0 <= low < gain["difference"] < high <= 1.0
  table = differences_table(rows).splitlines()
  assert table[3] == ("| rl − warm_start | context_recall | 3 | 1.000 | "
                      f"0.500 | +0.500 [{low:+.3f}, {high:+.3f}] |")


def test_seeds_are_pooled_per_question_on_the_questions_every_run_scored():
  base = _records({"a": ("single-hop", 0.0), "b": ("temporal", 0.0),
                   "c": ("temporal", 0.0)})
  seed0 = {"warm_start": base, "rl": _records(
      {"a": ("single-hop", 1.0), "b": ("temporal", 0.0),
       "c": ("temporal", 1.0)})}
  # The second seed did not score c: it leaves the pooled comparison.
  seed1 = {"warm_start": base, "rl": _records(
      {"a": ("single-hop", 1.0), "b": ("temporal", 1.0),
       "c": ("temporal", None)})}
  (row,) = seed_pooled_differences([seed0, seed1], COMPARISONS)
  assert (row["policy"], row["baseline"], row["n"]) == ("rl", "warm_start", 2)
  # Per seed on a, b: (1 + 0) / 2 and (1 + 1) / 2; averaged per question.
  assert row["per_run"] == [0.5, 1.0]
  assert row["difference"] == pytest.approx(0.75)
  assert row["policy_mean"] == pytest.approx(0.75)
  low, high = row["ci95"]
  assert 0.5 <= low <= row["difference"] <= high <= 1.0
  assert pooled_table([row]).splitlines()[2] == (
      f"| rl − warm_start | context_recall | 2 | +0.500, +1.000 | +0.750 "
      f"[{low:+.3f}, {high:+.3f}] |")
  # One run is `paired_differences`, without a per-run column.
  assert seed_pooled_differences([seed0], COMPARISONS) == (
      paired_differences(seed0, COMPARISONS))
  assert "per_run" not in paired_differences(seed0, COMPARISONS)[0]


def test_rank_statistics():
  assert auc(np.array([0.9, 0.8, 0.1, 0.2]),
                          np.array([1, 1, 0, 0])) == 1.0
  assert auc(np.array([0.5, 0.5]), np.array([1, 0])) == 0.5
  assert spearman(np.arange(5), np.arange(5) ** 3) == pytest.approx(1.0)
  assert np.isnan(spearman(np.ones(4), np.arange(4)))




def test_workdir_differences_pair_each_policy_with_itself():
  """This workdir minus the other, per policy evaluated in both, on the
  questions both scored."""
  ours = {"rl": _records({"a": ("single-hop", 1.0), "b": ("temporal", 1.0),
                          "c": ("temporal", 0.0)})}
  other = {"rl": _records({"a": ("single-hop", 0.0), "b": ("temporal", 1.0)}),
           "warm_start": _records({"a": ("single-hop", 0.0)})}
  (row,) = workdir_differences(ours, other, ["initial", "warm_start", "rl"])
  assert (row["policy"], row["baseline"], row["n"]) == ("rl", "rl", 2)
  assert row["difference"] == pytest.approx(0.5)
  assert row["policy_mean"] == 1.0 and row["baseline_mean"] == 0.5
