"""Metrics against hand-computed cases."""

import math

import pytest

from cmimem_jax.evaluation.metrics import (aggregate, best_over_golds,
                                           exact_match, locomo_f1,
                                           normalize_answer, recall_at_k,
                                           rouge_l_f1, substring_exact_match,
                                           token_f1)


def test_normalisation_and_exact_matches():
  assert normalize_answer("The  Cat, sat!") == "cat sat"
  assert normalize_answer("cats and dogs", drop_and=True) == "cats dogs"
  assert exact_match("The cat.", "cat") == 1.0
  assert exact_match("a dog", "cat") == 0.0
  assert substring_exact_match("I think it was Paris, France.", "paris") == 1
  assert substring_exact_match("Lyon", "Paris") == 0


def test_token_f1_hand_computed():
  # pred {red, car, fast}, gold {red, car}: P = 2/3, R = 1, F1 = 0.8.
  assert token_f1("the red car fast", "a red car") == pytest.approx(0.8)
  assert token_f1("", "") == 1.0
  assert token_f1("x", "") == 0.0
  # Stemming (LoCoMo): "running" and "runs" both stem to "run".
  assert token_f1("running", "runs") == 0.0
  assert token_f1("running", "runs", stem=True) == 1.0


def test_locomo_category_rules():
  # Multi-hop: gold items "paris", "rome"; best predicted items: 1 and 0.5.
  pred, gold = "Paris, Rome Italy", "Paris, Rome"
  want = (1.0 + 2 * (1 / 2) * 1 / (1 / 2 + 1)) / 2
  assert locomo_f1(pred, gold, "multi-hop") == pytest.approx(want)
  # Open-domain: only the part before ';' counts.
  assert locomo_f1("a dog", "dog; a cat", "open-domain") == 1.0
  # Adversarial: declining scores 1, anything else 0.
  assert locomo_f1("That is not mentioned.", "x", "adversarial") == 1.0
  assert locomo_f1("No information available", "x", "adversarial") == 1.0
  assert locomo_f1("She went to Paris", "Paris", "adversarial") == 0.0
  # Other categories: stemmed F1 with "and" dropped.
  assert locomo_f1("hiking and painting", "painted, hiked",
                   "single-hop") == pytest.approx(1.0)


def test_memoryagentbench_max_over_golds_and_rouge():
  golds = ["New York City", "NYC"]
  assert best_over_golds(substring_exact_match, "It is NYC.", golds) == 1.0
  assert best_over_golds(token_f1, "york", golds) == pytest.approx(0.5)
  with pytest.raises(ValueError):
    best_over_golds(token_f1, "x", [])
  # LCS "the cat on the mat" (5) vs lengths 6 and 6: F = 5/6.
  assert rouge_l_f1("the cat sat on the mat", "the cat lay on the mat") == \
      pytest.approx(5 / 6)


def test_recall_at_k():
  ranked = ["a", "b", "c", "d"]
  assert recall_at_k(ranked, ["a", "d"], 2) == 0.5
  assert recall_at_k(ranked, ["a", "d"], 4) == 1.0
  with pytest.raises(ValueError):
    recall_at_k(ranked, [], 2)


def test_aggregate_counts_failures_and_excludes_categories():
  records = [
      {"category": "a", "score": 1.0}, {"category": "a", "score": 0.0},
      {"category": "b", "score": 1.0}, {"category": "b", "score": None},
      {"category": "adversarial", "score": 0.0},
      {"category": "adversarial", "score": None, "unscorable": "no gold"}]
  out = aggregate(records)
  assert out["n"] == 6 and out["failures"] == 1 and out["scored"] == 4
  assert out["unscorable"] == 1
  assert out["overall"] == pytest.approx(2 / 4)
  assert out["by_category"] == {"a": 0.5, "adversarial": 0.0, "b": 1.0}
  assert out["task_averaged"] == pytest.approx(0.5)
  without = aggregate(records, exclude_from_overall=["adversarial"])
  assert without["overall"] == pytest.approx(2 / 3)
  assert without["task_averaged"] == pytest.approx(0.75)
  assert math.isnan(aggregate([])["overall"])
