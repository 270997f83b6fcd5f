"""tools/reproduce.py: the RESULTS.md table and the training plots, from
metrics and evaluation results shaped like the real jobs write them."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import reproduce  # noqa: E402


def _result(overall: float, temporal: float) -> dict:
  by_category = {"adversarial": 0.0, "single-hop": 1.0, "temporal": temporal}
  return {"n": 4, "by_category": by_category,
          "n_by_category": {"adversarial": 1, "single-hop": 1, "temporal": 2},
          "context_recall": {"overall": overall, "by_category": by_category,
                             "excluded_from_overall": ["adversarial"]},
          "evidence_recall": {"overall": 0.5, "by_category": {}}}


def test_results_table_has_one_row_per_category_and_missing_cells_marked():
  table = reproduce.results_table({"initial": _result(0.0, 0.0),
                                   "rl": _result(0.25, 0.125)})
  lines = table.splitlines()
  assert lines[0].startswith("| category | n | initial ctx recall")
  assert lines[2] == "| adversarial | 1 | 0.000 | — | 0.000 | — |"
  assert lines[3] == "| single-hop | 1 | 1.000 | — | 1.000 | — |"
  assert lines[4] == "| temporal | 2 | 0.000 | — | 0.125 | — |"
  # The overall figure leaves adversarial out, and its n says so.
  assert lines[5] == ("| overall (without adversarial) | 3 | 0.000 | 0.500 "
                      "| 0.250 | 0.500 |")


def test_plots_are_written_and_counts_stay_off_the_reward_axes(tmp_path):
  rl = [{"step": s, "reward/qa": 0.1 * s, "reward/cmi": 0.2,
         "reward/num_scored_operations": 40.0, "validity_rate": 1.0,
         "response_tokens_mean": 60.0, "kl": 0.01 * s,
         "reward_group_std": 0.05} for s in (1, 2, 3)]
  sft = [{"step": s, "nll": 2.0 / s} for s in (1, 2)]
  assert reproduce.plot_training(rl, sft, str(tmp_path)) == [
      "reward_terms.png", "rollout_stats.png", "warm_start_loss.png"]
  for s in (2, 3):  # Validated every 2 steps and at the last.
    rl[s - 1].update({"eval/reward": 0.3, "eval/qa": 0.2, "eval/cmi": 0.1,
                      "eval/sessions": 2})
  names = reproduce.plot_training(rl, sft, str(tmp_path))
  assert names == ["reward_terms.png", "rollout_stats.png",
                   "validation.png", "warm_start_loss.png"]
  for name in names:
    assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
  assert reproduce.reward_terms(rl) == ["reward/cmi", "reward/qa"]
  assert reproduce.plot_training(rl, [], str(tmp_path))[-1] == (
      "validation.png")
