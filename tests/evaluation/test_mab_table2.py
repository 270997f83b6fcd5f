"""Table 17 metrics and Table 2 averages of MemoryAgentBench."""

import json

import pytest

from cmimem_jax.evaluation.run import evaluate
from cmimem_jax.evaluation.memoryagentbench import (
    GROUPS, recommendation_recall_at_5, table2_scores, table17_column)
from cmimem_jax.testing.fake_openai import FakeOpenAI, reply_for

from test_evaluate import eval_config, read_jsonl  # noqa: I100


def test_each_task_has_its_table_17_column_and_metric():
  assert table17_column("ruler_qa1_197K") == ("AR/SH-QA", "score")
  assert table17_column("longmemeval_s*") == ("AR/LME(S*)", "score")
  assert table17_column("icl_banking77_5900shot_balance") == ("TTL/MCC",
                                                              "score")
  assert table17_column("recsys_redial_full") == ("TTL/Recom.",
                                                  "recall_at_5")
  assert table17_column("infbench_sum_eng_shots2") == ("LRU/Summ.",
                                                       "rouge_l_f1")
  assert table17_column("factconsolidation_sh_6k") == ("SF/FC-SH", "score")
  assert table17_column("factconsolidation_mh_6k") is None  # App. J.2.
  assert table17_column("unknown") is None


def test_recommendation_recall_at_5_matches_titles_by_edit_distance():
  golds = ["The Matrix (1999)", "Inception", "Heat"]
  prediction = ("1. The Matrix 1999\n2. Incepton\n3. Alien\n4. Up\n"
                "5. Jaws\n6. Heat")
  # Matrix (punctuation aside) and Incepton (one letter) match; Heat is 6th.
  assert recommendation_recall_at_5(prediction, golds) == pytest.approx(2 / 3)
  assert recommendation_recall_at_5("Heat, Alien", golds) == pytest.approx(
      1 / 3)
  with pytest.raises(ValueError):
    recommendation_recall_at_5("x", ["", "  "])


def _record(source, **metrics):
  return {"category": source, **metrics}


def test_table2_averages_columns_then_groups():
  records = [
      _record("ruler_qa1_1", score=1.0), _record("ruler_qa1_1", score=0.0),
      _record("ruler_qa2_1", score=1.0), _record("longmemeval_s*", score=0.0),
      _record("eventqa_full", score=1.0), _record("icl_trec", score=0.5),
      _record("recsys_redial_full", score=0.0, recall_at_5=0.25),
      _record("infbench_sum", score=1.0, rouge_l_f1=0.2),
      _record("detective_qa", score=None),  # A failed judgement.
      _record("detective_qa", score=1.0),
      _record("factconsolidation_sh_6k", score=0.0),
      _record("factconsolidation_mh_6k", score=1.0)]
  table = table2_scores(records)
  assert table["AR/SH-QA"] == 0.5 and table["TTL/Recom."] == 0.25
  assert table["LRU/Summ."] == 0.2 and table["LRU/DetQA"] == 1.0
  assert table["AR"] == pytest.approx((0.5 + 1 + 0 + 1) / 4)
  assert table["TTL"] == pytest.approx((0.5 + 0.25) / 2)
  assert table["LRU"] == pytest.approx(0.6) and table["SF"] == 0.0
  assert table["Overall"] == pytest.approx(
      (0.625 + 0.375 + 0.6 + 0.0) / 4)
  assert table["n"]["LRU/DetQA"] == 1 and "factconsolidation" not in str(
      table["n"])
  # A group missing a column is not averaged over what is there.
  partial = table2_scores(records[:2])
  assert set(partial) == {"AR/SH-QA", "n"}
  assert set(GROUPS) == {"AR", "TTL", "LRU", "SF"}


def _mab_file(tmp_path):
  rows = [
      {"context": "Alice: I loved The Matrix and Heat. Bob: try Inception.",
       "questions": ["Recommend movies for Alice."],
       "answers": [["The Matrix", "Heat"]],
       "metadata": {"source": "recsys_redial_full", "qa_pair_ids": ["r1"]}},
      {"context": "The key is under the blue mat near the door.",
       "questions": ["Where is the key?", "What colour is the mat?"],
       "answers": [["under the blue mat"], ["blue"]],
       "metadata": {"source": "ruler_qa1_197K", "qa_pair_ids": ["k1", "k2"]}},
  ]
  path = tmp_path / "mab.json"
  path.write_text(json.dumps(rows))
  return str(path)


def mab_reply(content: str) -> str:
  if "Gold answer:" in content:
    return reply_for(content)
  if "Recommend" in content:
    return "1. The Matrix\n2. Alien\n3. Jaws"
  return "It is under the blue mat."


def test_evaluation_reports_table_2_with_table_17_metrics(tmp_path):
  with FakeOpenAI(reply=mab_reply, delay_s=0.0) as server:
    overrides = {"dataset.name": "memoryagentbench", "judge.kind": "llm",
                 "answer.kind": "endpoint"}
    for section in ("answer", "judge"):
      overrides[f"{section}.endpoint.base_url"] = server.base_url
      overrides[f"{section}.endpoint.model"] = "fake"
    result = evaluate(eval_config(_mab_file(tmp_path), **overrides),
                      str(tmp_path / "run"))
  table = result["table2"]
  # Recommendation: Recall@5 (1 of 2 gold titles), not the judge.
  assert table["TTL/Recom."] == 0.5
  # Ruler QA1: the judge (the fake judges both answers correct).
  assert table["AR/SH-QA"] == 1.0 and table["n"]["AR/SH-QA"] == 2
  assert "Overall" not in table  # Most columns have no rows here.
  records = read_jsonl(tmp_path / "run" / "predictions.jsonl")
  assert [r["recall_at_5"] for r in records if "recall_at_5" in r] == [0.5]
