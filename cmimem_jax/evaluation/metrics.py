"""Answer metrics (SPEC §6) and per-category aggregation.

Text metrics follow the benchmarks' own scripts: SQuAD normalisation
(lower-case, strip punctuation and articles, collapse whitespace); LoCoMo's
token F1 additionally drops "and" and Porter-stems every token, splits
category-1 (multi-hop) answers on commas and scores category 5
(adversarial) by whether the model declines; MemoryAgentBench scores the
best match over every gold answer.
"""

from __future__ import annotations

import collections
import functools
import re
import string
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

_PUNCTUATION = set(string.punctuation)


def normalize_answer(text: str, drop_and: bool = False) -> str:
  """SQuAD normalisation (LoCoMo's variant also drops "and")."""
  text = str(text).lower()
  text = "".join(ch for ch in text if ch not in _PUNCTUATION)
  articles = r"\b(a|an|the|and)\b" if drop_and else r"\b(a|an|the)\b"
  text = re.sub(articles, " ", text)
  return " ".join(text.split())


@functools.cache
def _stemmer():
  from nltk.stem import PorterStemmer
  return PorterStemmer()


def _tokens(text: str, stem: bool) -> list[str]:
  tokens = normalize_answer(text, drop_and=stem).split()
  if stem:
    stemmer = _stemmer()
    tokens = [stemmer.stem(t) for t in tokens]
  return tokens


def token_f1(prediction: str, gold: str, stem: bool = False) -> float:
  """Bag-of-tokens F1 after normalisation (Porter stems when `stem`)."""
  pred, ref = _tokens(prediction, stem), _tokens(gold, stem)
  common = collections.Counter(pred) & collections.Counter(ref)
  overlap = sum(common.values())
  if not pred or not ref:
    return float(pred == ref)
  if overlap == 0:
    return 0.0
  precision, recall = overlap / len(pred), overlap / len(ref)
  return 2 * precision * recall / (precision + recall)


def exact_match(prediction: str, gold: str) -> float:
  return float(normalize_answer(prediction) == normalize_answer(gold))


def substring_exact_match(prediction: str, gold: str) -> float:
  """1 if the normalised gold occurs in the normalised prediction."""
  return float(normalize_answer(gold) in normalize_answer(prediction))


@functools.cache
def _rouge_scorer():
  from rouge_score import rouge_scorer
  return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)


def rouge_l_f1(prediction: str, gold: str) -> float:
  """ROUGE-L F-measure (`rouge_score`, Porter stemming)."""
  return _rouge_scorer().score(gold, prediction)["rougeL"].fmeasure


def best_over_golds(metric, prediction: str, golds: Sequence[str]) -> float:
  """MemoryAgentBench: the best score over every accepted gold answer."""
  if not golds:
    raise ValueError("no gold answers")
  return max(metric(prediction, gold) for gold in golds)


LOCOMO_DECLINES = ("no information available", "not mentioned")


def locomo_f1(prediction: str, gold: str, category: str) -> float:
  """LoCoMo's QA score for one answer (its `eval_question_answering`).

  - multi-hop: gold and prediction are comma-separated lists; mean over
    gold items of the best stemmed F1 against any predicted item;
  - open-domain: only the gold before the first ';' counts;
  - adversarial: 1 if the prediction declines ("no information available"
    or "not mentioned"), else 0;
  - other categories: stemmed token F1.
  """
  if category == "adversarial":
    lowered = prediction.lower()
    return float(any(phrase in lowered for phrase in LOCOMO_DECLINES))
  if category == "multi-hop":
    predictions = [p.strip() for p in prediction.split(",")]
    golds = [g.strip() for g in gold.split(",")]
    return sum(max(token_f1(p, g, stem=True) for p in predictions)
               for g in golds) / len(golds)
  if category == "open-domain":
    gold = gold.split(";")[0].strip()
  return token_f1(prediction, gold, stem=True)


def recall_at_k(ranked: Sequence[str], relevant: Iterable[str], k: int
                ) -> float:
  """Fraction of `relevant` items found in the first k of `ranked`."""
  relevant = set(relevant)
  if not relevant:
    raise ValueError("recall@k needs at least one relevant item")
  return len(relevant & set(ranked[:k])) / len(relevant)


def mean(values: Iterable[float]) -> float:
  values = list(values)
  return sum(values) / len(values) if values else float("nan")


def bootstrap_interval(values: Sequence[float], rng: np.random.Generator,
                       resamples: int = 1000) -> tuple[float, float]:
  """95% percentile bootstrap interval of the mean of `values` `[n]`
  (nan, nan when empty). For a paired comparison pass the per-item
  differences: resampling items keeps each pair together."""
  values = np.asarray(values, float)
  if len(values) == 0:
    return float("nan"), float("nan")
  means = values[rng.integers(0, len(values), (resamples, len(values)))
                 ].mean(1)
  return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def aggregate(records: Sequence[Mapping], score_key: str = "score",
              category_key: str = "category",
              exclude_from_overall: Iterable[str] = ()) -> dict:
  """Overall, per-category and task-averaged means of scored records.

  Records whose score is None are left out of every mean, never scored as
  0 or 1: counted in `unscorable` when they say why (`"unscorable"`: the
  metric does not apply, e.g. context recall of an unanswerable question),
  else in `failures` (a failed judgement).

  Returns:
    `{"overall", "task_averaged", "by_category", "n", "scored",
    "failures", "unscorable", "n_by_category", "excluded_from_overall"}`;
    categories in `exclude_from_overall`
    (LoCoMo's adversarial, for its "without category 5" figure) are still
    reported per category but left out of overall and task-averaged.
  """
  excluded = set(exclude_from_overall)
  by_category: dict[str, list[float]] = collections.defaultdict(list)
  counts: dict[str, int] = collections.Counter()
  failures = unscorable = 0
  for record in records:
    counts[record[category_key]] += 1
    if record.get(score_key) is None:
      if record.get("unscorable"):
        unscorable += 1
      else:
        failures += 1
      continue
    by_category[record[category_key]].append(float(record[score_key]))
  scores = [s for c, values in by_category.items() if c not in excluded
            for s in values]
  categories = {c: mean(v) for c, v in sorted(by_category.items())}
  return {
      "overall": mean(scores),
      "task_averaged": mean(v for c, v in categories.items()
                            if c not in excluded),
      "by_category": categories,
      "n": len(records), "scored": sum(len(v) for v in by_category.values()),
      "failures": failures, "unscorable": unscorable,
      "n_by_category": dict(sorted(counts.items())),
      "excluded_from_overall": sorted(excluded),
  }
