"""MemoryAgentBench as the paper scores it (Table 17, Table 2, App. J).

Each task (a row's `metadata.source`) is one column of Table 2 with its own
metric: Recall@5 for the Redial recommendations (gold movie titles matched
by edit distance), ROUGE-L F1 for InfBench summarisation, the judge
(`score`) everywhere else. Columns average into the AR / TTL / LRU / SF
groups and those into Overall. FactConsolidation multi-hop (FC-MH) is
reported per category but left out of Table 2 (App. J.2).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping, Sequence
from typing import Any

from cmimem_jax.evaluation.metrics import mean, normalize_answer

# (source prefix, Table 2 column, metric record key), first match wins.
TABLE17 = (
    ("ruler_qa1", "AR/SH-QA", "score"),
    ("ruler_qa2", "AR/MH-QA", "score"),
    ("longmemeval", "AR/LME(S*)", "score"),
    ("eventqa", "AR/EventQA", "score"),
    ("icl_", "TTL/MCC", "score"),
    ("recsys_redial", "TTL/Recom.", "recall_at_5"),
    ("infbench_sum", "LRU/Summ.", "rouge_l_f1"),
    ("detective", "LRU/DetQA", "score"),
    ("factconsolidation_sh", "SF/FC-SH", "score"),
)
EXCLUDED = ("factconsolidation_mh",)  # App. J.2.
GROUPS = {"AR": ("AR/SH-QA", "AR/MH-QA", "AR/LME(S*)", "AR/EventQA"),
          "TTL": ("TTL/MCC", "TTL/Recom."), "LRU": ("LRU/Summ.", "LRU/DetQA"),
          "SF": ("SF/FC-SH",)}
# Two titles match when difflib's ratio of their normalised forms reaches
# this (the official scorer matches movie names by edit distance).
TITLE_MATCH_RATIO = 0.8
_LIST_ITEM = re.compile(r"\n+|,|;|\s\d+[.)]\s")


def table17_column(source: str) -> tuple[str, str] | None:
  """`(column, metric key)` of a task, None when it is excluded or not
  part of Table 2."""
  lowered = source.lower()
  if lowered.startswith(EXCLUDED):
    return None
  for prefix, column, metric in TABLE17:
    if lowered.startswith(prefix):
      return column, metric
  return None


def _titles(text: str) -> list[str]:
  items = (normalize_answer(re.sub(r"^\s*\d+[.)]\s*", "", item))
           for item in _LIST_ITEM.split(text))
  return [item for item in items if item]


def recommendation_recall_at_5(prediction: str, golds: Sequence[str]
                               ) -> float:
  """Fraction of gold titles matched by one of the first five titles the
  prediction lists (lines, commas, semicolons or numbered items)."""
  predicted = _titles(prediction)[:5]
  wanted = [normalize_answer(g) for g in golds if normalize_answer(g)]
  if not wanted:
    raise ValueError("no gold titles")
  hits = sum(any(difflib.SequenceMatcher(None, gold, title).ratio()
                 >= TITLE_MATCH_RATIO for title in predicted)
             for gold in wanted)
  return hits / len(wanted)


def table2_scores(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
  """Table 2's columns, group averages and Overall (fractions in [0, 1])
  from scored records (`category` = source). A column, group or Overall
  without all of its parts scored is left out rather than averaged over
  what is there; `n` counts the records each column used."""
  values: dict[str, list[float]] = {}
  for record in records:
    found = table17_column(record["category"])
    if found is None:
      continue
    column, metric = found
    if record.get(metric) is not None:
      values.setdefault(column, []).append(float(record[metric]))
  columns = {c: mean(v) for c, v in values.items()}
  groups = {g: mean(columns[c] for c in parts)
            for g, parts in GROUPS.items()
            if all(c in columns for c in parts)}
  out: dict[str, Any] = {**columns, **groups,
                         "n": {c: len(v) for c, v in values.items()}}
  if len(groups) == len(GROUPS):
    out["Overall"] = mean(groups.values())
  return out
