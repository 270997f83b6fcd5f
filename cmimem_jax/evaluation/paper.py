"""The paper's published numbers (Tables 1, 2, 3, 9) and their comparison
with our evaluation results (`tools/compare_paper.py`).

The numbers live as data in `paper_results.json` (accuracy in percent, rows
named as in the paper). A comparison puts our result beside every row of
each table that reports its benchmark, with the difference to one reference
row, and lists the settings under the table (answer model, judge, split,
n) so that unlike runs are not compared silently.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from cmimem_jax import storage

# Our LongMemEval categories (its `question_type`s) as Table 3/9 columns.
LONGMEMEVAL_COLUMNS = {
    "knowledge-update": "KU", "multi-session": "MS",
    "single-session-assistant": "SS-A", "single-session-preference": "SS-P",
    "single-session-user": "SS-U", "temporal-reasoning": "TR"}
# The paper's headline row per table (what "Δ" is taken against).
HEADLINE_ROWS = {"table1": "CMI-Mem-4B", "table2": "CMI-Mem-4B",
                 "table3": "CMI-Mem (full)", "table9": "CMI-Mem (full)"}
# Tables that report each of our datasets, and the column its overall is.
TABLES_OF = {"longmemeval": (("table1", "LME-S"), ("table3", "Overall"),
                             ("table9", "Overall")),
             "locomo": (("table1", "LoCoMo"),),
             "memoryagentbench": (("table1", "MABench"), ("table2", "Overall"))}


@functools.cache
def _paper() -> dict[str, Any]:
  path = os.path.join(os.path.dirname(__file__), "paper_results.json")
  with open(path) as f:
    return json.load(f)


def paper_table(table: str) -> dict[str, Any]:
  """One table: `{"title", "columns", "settings", "rows"}`."""
  tables = _paper()["tables"]
  if table not in tables:
    raise KeyError(f"unknown table {table!r}; have {sorted(tables)}")
  return tables[table]


def paper_rows(table: str) -> list[dict[str, Any]]:
  """The table's rows: `{"variant": name, column: percent, ...}`."""
  return paper_table(table)["rows"]


def _read_json(path: str) -> Any:
  """A JSON file's value; a malformed one raises ValueError naming the
  file, line and column."""
  try:
    return json.loads(storage.path(path).read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}:{e.lineno}:{e.colno}: not JSON: {e.msg}"
                     ) from None


@dataclasses.dataclass(frozen=True)
class OurResult:
  """One evaluation workdir: its `results.json` and `settings.json`."""
  label: str
  result: Mapping[str, Any]
  settings: Mapping[str, Any]

  @classmethod
  def load(cls, workdir: str) -> OurResult:
    """Reads a workdir's files.

    Raises:
      ValueError: a file is not JSON (naming it, its line and column), or
        results.json is not an evaluation's results.
    """
    path = storage.join(workdir, "results.json")
    result = _read_json(path)
    if not (isinstance(result, dict) and isinstance(
        result.get("dataset"), str) and isinstance(
            result.get("overall"), (int, float, type(None)))):
      raise ValueError(f"{path}: not the results.json of `python -m "
                       "cmimem_jax.evaluate` (needs 'dataset' and "
                       "'overall')")
    settings_path = storage.join(workdir, "settings.json")
    settings = {}
    if storage.path(settings_path).exists():
      settings = _read_json(settings_path)
    return cls(os.path.basename(os.path.normpath(workdir)), result, settings)

  def columns(self, overall_column: str, without_category_5: bool = False
              ) -> dict[str, float]:
    """Our numbers in percent under the table's column names
    (`without_category_5`: LoCoMo's overall without the adversarial
    category, as prior work reports it)."""
    if self.result["dataset"] == "memoryagentbench":
      # Table 2's protocol (Table 17 metrics, groups, FC-MH excluded); its
      # Overall only when every group was scored.
      table2 = self.result.get("table2", {})
      out = {k: 100.0 * v for k, v in table2.items()
             if isinstance(v, (int, float))}
      if "Overall" in out:
        out[overall_column] = out["Overall"]
      return out
    overall = self.result["overall"]
    if without_category_5:
      overall = self.result["without_adversarial"]
    out = {overall_column: 100.0 * overall}
    if self.result["dataset"] == "longmemeval":
      for category, column in LONGMEMEVAL_COLUMNS.items():
        value = self.result.get("by_category", {}).get(category)
        if value is not None:
          out[column] = 100.0 * value
    return out

  def reference_row(self, table: str) -> str:
    """The paper row a run is compared against: the matching RAG row for a
    `rag` run of Table 1, else the table's headline row."""
    top_k = self.settings.get("rag_top_k")
    if table == "table1" and self.result.get("method") == "rag" and top_k:
      return f"RAG (top-{top_k})"
    return HEADLINE_ROWS[table]

  def setting_lines(self) -> dict[str, str]:
    """Our side of the settings the paper's tables state."""
    # A model as `settings.json` records it (`run.result_settings`: a
    # mapping, or None for no model), not a config section.
    def model(recorded: Mapping[str, Any] | None) -> str:
      if not recorded:
        return "none"
      return (recorded.get("model") or recorded.get("path")
              or recorded["kind"])
    judge = self.settings.get("judge", {})
    judge_text = self.result.get("judge", "?")
    if judge.get("model"):
      judge_text = f"{judge['model']} (LLM judge, {judge.get('prompt')})"
    encoder = self.settings.get("encoder", {})
    n = (f"{self.result.get('scored')} scored of {self.result.get('n')}"
         f" ({self.result.get('failures', 0)} failed, "
         f"{self.result.get('unscorable', 0)} unscorable)")
    return {
        "method": str(self.result.get("method")),
        "policy": model(self.settings.get("builder")),
        "answer_model": model(self.settings.get("answer")),
        "judge": judge_text,
        "encoder": encoder.get("path") or encoder.get("kind", "?"),
        "split": (f"{self.settings.get('dataset_file', '?')}, split "
                  f"{self.settings.get('split', '?')}"),
        "n": n}


def compare(ours: Sequence[OurResult]) -> list[dict[str, Any]]:
  """Side-by-side tables: for each of our results, every paper table that
  reports its dataset.

  Returns:
    One dict per (result, table): `{"table", "title", "label", "columns",
    "paper", "ours", "reference", "difference", "settings"}`; `difference`
    is ours − reference row per shared column, in percentage points;
    `settings` maps each stated setting to `{"paper", "ours", "differs"}`.
    LoCoMo results also carry `ours_without_category_5` and its
    `difference_without_category_5` (the paper does not say whether its
    LoCoMo column counts category 5; prior work leaves it out).
  """
  out = []
  for result in ours:
    dataset = result.result["dataset"]
    if dataset not in TABLES_OF:
      raise ValueError(f"{result.label}: no paper table reports {dataset!r}")
    for table, overall_column in TABLES_OF[dataset]:
      spec = paper_table(table)
      mine = result.columns(overall_column)
      reference = result.reference_row(table)
      by_name = {row["variant"]: row for row in spec["rows"]}
      columns = [c for c in spec["columns"] if c in mine]
      if not columns:
        continue  # E.g. MABench's Overall before every group is scored.
      ours_settings = result.setting_lines()
      settings = {}
      for key, paper_value in spec["settings"].items():
        value = ours_settings.get(key, "not recorded")
        settings[key] = {"paper": paper_value, "ours": value,
                         "differs": value.lower() not in paper_value.lower()}
      for key in ("method", "encoder"):
        settings.setdefault(key, {"paper": spec["settings"].get(key, "-"),
                                  "ours": ours_settings[key],
                                  "differs": False})
      item = {
          "table": table, "title": spec["title"], "label": result.label,
          "columns": columns,
          "paper": [{"variant": r["variant"], **{c: r[c] for c in columns}}
                    for r in spec["rows"]],
          "ours": {c: mine[c] for c in columns},
          "reference": reference,
          "difference": {c: mine[c] - by_name[reference][c]
                         for c in columns},
          "settings": settings}
      if dataset == "locomo" and "without_adversarial" in result.result:
        alone = result.columns(overall_column, without_category_5=True)
        item["ours_without_category_5"] = {c: alone[c] for c in columns}
        item["difference_without_category_5"] = {
            c: alone[c] - by_name[reference][c] for c in columns}
      out.append(item)
  return out


def _number(value: float) -> str:
  return "n/a" if value is None or math.isnan(value) else f"{value:.2f}"


def to_markdown(comparisons: Sequence[Mapping[str, Any]]) -> str:
  """Markdown tables a user can paste into a paper, settings under each."""
  blocks = []
  for item in comparisons:
    columns = item["columns"]
    lines = [f"### {item['title']} — ours: `{item['label']}`", "",
             "| Variant | " + " | ".join(columns) + " |",
             "|---" * (len(columns) + 1) + "|"]
    for row in item["paper"]:
      name = row["variant"]
      marker = " (reference)" if name == item["reference"] else ""
      lines.append(f"| {name}{marker} | " + " | ".join(
          _number(row[c]) for c in columns) + " |")
    lines.append(f"| **ours: {item['label']}** | " + " | ".join(
        f"**{_number(item['ours'][c])}**" for c in columns) + " |")
    lines.append(f"| Δ ours − {item['reference']} | " + " | ".join(
        f"{item['difference'][c]:+.2f}" for c in columns) + " |")
    if "ours_without_category_5" in item:
      lines.append(f"| **ours: {item['label']}, without category 5** | "
                   + " | ".join(
                       f"**{_number(item['ours_without_category_5'][c])}**"
                       for c in columns) + " |")
      lines.append(f"| Δ without category 5 − {item['reference']} | "
                   + " | ".join(
                       f"{item['difference_without_category_5'][c]:+.2f}"
                       for c in columns) + " |")
    lines += ["", "| Setting | Paper | Ours |", "|---|---|---|"]
    for key, value in item["settings"].items():
      flag = " ⚠ differs" if value["differs"] else ""
      lines.append(f"| {key} | {value['paper']} | {value['ours']}{flag} |")
    blocks.append("\n".join(lines))
  return "\n\n".join(blocks) + "\n"
