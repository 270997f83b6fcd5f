import json

import pytest

from cmimem_jax.data import DatasetError, chunk_text, load_memoryagentbench

ROWS = [
    {"context": "Alice moved to Paris in 2019. " * 40 + "She adopted a cat.",
     "questions": ["Where did Alice move?", "What pet?"],
     "answers": [["Paris", "paris, France"], ["a cat"]],
     "metadata": {"source": "ruler_qa1", "qa_pair_ids": ["a", "b"]}},
    {"context": "Bob likes tea.", "questions": ["Drink?"],
     "answers": [["tea"]], "metadata": {"source": "eventqa"}},
]


def _check(dialogues):
  assert len(dialogues) == 2
  first = dialogues[0]
  assert len(first.sessions) > 1
  assert all(len(s.turns[0].text) <= 256 for s in first.sessions)
  joined = " ".join(s.turns[0].text for s in first.sessions)
  assert joined == " ".join(ROWS[0]["context"].split())
  q = first.questions[0]
  assert (q.question_id, q.answer, q.all_answers, q.category) == (
      "ruler_qa1:0:a", "Paris", ("Paris", "paris, France"), "ruler_qa1")
  assert dialogues[1].questions[0].question_id == "eventqa:1:q0"


def test_json_and_jsonl(tmp_path):
  path = tmp_path / "mab.json"
  path.write_text(json.dumps(ROWS))
  _check(load_memoryagentbench(str(path), chunk_chars=256))
  path = tmp_path / "mab.jsonl"
  path.write_text("\n".join(json.dumps(r) for r in ROWS))
  _check(load_memoryagentbench(str(path), chunk_chars=256))


def test_parquet(tmp_path):
  pa = pytest.importorskip("pyarrow")
  import pyarrow.parquet as pq
  path = tmp_path / "mab.parquet"
  pq.write_table(pa.Table.from_pylist(ROWS), str(path))
  _check(load_memoryagentbench(str(path), chunk_chars=256))


def test_bad_parquet(tmp_path):
  path = tmp_path / "x.parquet"
  path.write_bytes(b"PAR1 not really")
  with pytest.raises(DatasetError, match="unreadable parquet"):
    load_memoryagentbench(str(path))


@pytest.mark.parametrize("row,field", [
    ({"questions": ["q"], "answers": [["a"]]}, "context"),
    ({"context": "c", "questions": ["q"], "answers": []}, "answers"),
    ({"context": "c", "questions": ["q"], "answers": [[]]}, "answers[0]"),
    ({"context": "c", "questions": ["q"], "answers": [["a"]],
      "metadata": {"qa_pair_ids": ["x", "y"]}}, "metadata.qa_pair_ids"),
    ({"context": "c", "questions": ["q", "r"], "answers": [["a"], ["b"]],
      "metadata": {"qa_pair_ids": ["x", "x"]}}, "metadata.qa_pair_ids"),
    ({"context": "  ", "questions": [], "answers": []}, "context"),
])
def test_malformed(tmp_path, row, field):
  path = tmp_path / "mab.json"
  path.write_text(json.dumps([row]))
  with pytest.raises(DatasetError) as info:
    load_memoryagentbench(str(path))
  assert "record 0" in str(info.value) and repr(field) in str(info.value)


def test_chunk_text():
  assert chunk_text("a b c d", 3) == ["a b", "c d"]
  assert chunk_text("abcdefg", 3) == ["abc", "def", "g"]
  assert chunk_text("", 3) == []
  with pytest.raises(ValueError):
    chunk_text("x", 0)


def test_rows_reusing_qa_pair_ids_keep_distinct_question_ids(tmp_path):
  rows = [dict(ROWS[0]), dict(ROWS[0])]  # Two rows, same qa_pair_ids.
  path = tmp_path / "mab.json"
  path.write_text(json.dumps(rows))
  ids = [q.question_id for d in load_memoryagentbench(str(path))
         for q in d.questions]
  assert len(set(ids)) == len(ids) == 4
