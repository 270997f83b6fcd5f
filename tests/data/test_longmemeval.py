import datetime as dt
import json

import pytest

from cmimem_jax.data import LONGMEMEVAL_TYPES, DatasetError, load_longmemeval


def test_sample(longmemeval_sample_path):
  dialogues = load_longmemeval(longmemeval_sample_path)
  assert [d.dialogue_id for d in dialogues] == ["6a1eabeb", "gpt4_70e84552_abs"]
  first = dialogues[0]
  assert [s.session_id for s in first.sessions] == [
      "answer_a25d4a91_1", "answer_a25d4a91_2"]
  assert first.sessions[0].date == dt.datetime(2023, 5, 25, 20, 21)
  q = first.questions[0]
  assert q.category == "knowledge-update" and q.category in LONGMEMEVAL_TYPES
  assert q.question_date == dt.datetime(2023, 6, 1, 0, 58)
  assert q.evidence_sessions == ("answer_a25d4a91_1", "answer_a25d4a91_2")
  # Evidence turns are exactly those flagged has_answer.
  flagged = [t.turn_id for s in first.sessions for t in s.turns if t.has_answer]
  assert q.evidence == tuple(flagged) and flagged
  assert not q.is_abstention and dialogues[1].questions[0].is_abstention
  turn = first.sessions[0].turns[0]
  assert (turn.turn_id, turn.role, turn.speaker) == (
      "answer_a25d4a91_1:0", "user", "user")


def test_paper_splits_are_disjoint(longmemeval_sample_path):
  import pathlib
  splits_path = pathlib.Path(longmemeval_sample_path).with_name(
      "longmemeval_splits.json")
  splits = json.loads(splits_path.read_text())
  assert {k: len(v) for k, v in splits.items()} == {
      "sft": 50, "rl": 50, "test": 400}
  assert not set(splits["rl"]) & set(splits["test"])


def _record(**overrides):
  record = {
      "question_id": "q1", "question_type": "single-session-user",
      "question": "What?", "answer": "That.",
      "question_date": "2023/06/01 (Thu) 00:58",
      "haystack_dates": ["2023/05/25 (Thu) 20:21"],
      "haystack_session_ids": ["s1"],
      "haystack_sessions": [[{"role": "user", "content": "hello",
                              "has_answer": True}]],
      "answer_session_ids": ["s1"],
  }
  record.update(overrides)
  return record


def test_session_qa_extension(tmp_path):
  path = tmp_path / "train.json"
  path.write_text(json.dumps([_record(session_qa={
      "s1": [{"question": "Who?", "answer": "Me", "type": "single-session"}]})]))
  (dialogue,) = load_longmemeval(str(path))
  assert len(dialogue.questions) == 2
  qa = dialogue.questions[1]
  assert (qa.question, qa.answer, qa.category, qa.evidence_sessions) == (
      "Who?", "Me", "single-session", ("s1",))


@pytest.mark.parametrize("overrides,field", [
    ({"haystack_dates": []}, "haystack_sessions"),
    ({"haystack_sessions": [[{"role": "robot", "content": "x"}]]},
     "haystack_sessions[0][0].role"),
    ({"haystack_sessions": [[{"role": "user"}]]},
     "haystack_sessions[0][0].content"),
    ({"question_date": "yesterday"}, "question_date"),
    ({"question": None}, "question"),
    ({"session_qa": {"nope": []}}, "session_qa.nope"),
])
def test_malformed(tmp_path, overrides, field):
  path = tmp_path / "lme.json"
  path.write_text(json.dumps([_record(**overrides)]))
  with pytest.raises(DatasetError) as info:
    load_longmemeval(str(path))
  assert str(path) in str(info.value)
  assert "record q1" in str(info.value)
  assert repr(field) in str(info.value)
