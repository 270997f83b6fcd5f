import collections
import datetime as dt
import json

import pytest

from cmimem_jax.data import DatasetError, load_locomo


def test_counts_match_the_release(locomo_dialogues):
  assert len(locomo_dialogues) == 10
  assert sum(len(d.sessions) for d in locomo_dialogues) == 272
  questions = [q for d in locomo_dialogues for q in d.questions]
  assert len(questions) == 1986
  assert collections.Counter(q.category for q in questions) == {
      "multi-hop": 282, "temporal": 321, "open-domain": 96,
      "single-hop": 841, "adversarial": 446}


def test_every_session_key_is_loaded_in_order(locomo_path, locomo_dialogues):
  with open(locomo_path) as f:
    raw = json.load(f)
  for record, dialogue in zip(raw, locomo_dialogues):
    keys = [k for k in record["conversation"]
            if k.startswith("session_") and not k.endswith("date_time")]
    numbers = sorted(int(k.split("_")[1]) for k in keys)
    assert [s.session_id for s in dialogue.sessions] == [
        f"{record['sample_id']}:session_{n}" for n in numbers]
    assert [s.index for s in dialogue.sessions] == list(range(len(numbers)))
    for session, n in zip(dialogue.sessions, numbers):
      assert len(session.turns) == len(record["conversation"][f"session_{n}"])


def test_dates_are_parsed(locomo_dialogues):
  first = locomo_dialogues[0].sessions[0]
  assert first.date_text == "1:56 pm on 8 May, 2023"
  assert first.date == dt.datetime(2023, 5, 8, 13, 56)
  for dialogue in locomo_dialogues:
    dates = [s.date for s in dialogue.sessions]
    assert all(isinstance(d, dt.datetime) for d in dates)
    for q in dialogue.questions:
      assert q.question_date == dates[-1]


def test_turns_and_questions(locomo_dialogues):
  conv = locomo_dialogues[0]
  turn = conv.sessions[0].turns[0]
  assert (turn.turn_id, turn.speaker, turn.role) == ("D1:1", "Caroline", "user")
  assert conv.sessions[0].turns[1].role == "assistant"
  assert conv.turn("D1:3").text.startswith("I went to a LGBTQ support group")
  q = conv.questions[0]
  assert (q.question, q.answer, q.category, q.evidence) == (
      "When did Caroline go to the LGBTQ support group?", "7 May 2023",
      "temporal", ("D1:3",))
  # Non-string answers are kept as text.
  assert conv.questions[1].answer == "2022"
  adversarial = [q for q in conv.questions if q.category == "adversarial"]
  # Category 5: the planted answer is kept, the gold is the refusal.
  assert all(q.adversarial_answer and q.is_abstention for q in adversarial)
  assert {q.answer for q in adversarial} == {"Not answerable"}
  assert adversarial[0].adversarial_answer == "self-care is important"
  assert not any(q.is_abstention for q in conv.questions
                 if q.category != "adversarial")
  # Image shares are kept in the text.
  assert any("[shares image:" in t.text for s in conv.sessions for t in s.turns)


def test_evidence_ids_refer_to_real_turns(locomo_dialogues):
  known = {t.turn_id for d in locomo_dialogues for s in d.sessions
           for t in s.turns}
  evidence = [e for d in locomo_dialogues for q in d.questions
              for e in q.evidence]
  assert len(evidence) > 2500
  # LoCoMo has a handful of dangling ids (typos in the release); they stay
  # visible rather than being dropped.
  assert sum(e in known for e in evidence) / len(evidence) > 0.99


@pytest.mark.parametrize("mutate,field", [
    (lambda r: r.pop("sample_id"), "sample_id"),
    (lambda r: r["conversation"].pop("session_1_date_time"),
     "conversation.session_1_date_time"),
    (lambda r: r["conversation"]["session_1"][0].pop("text"),
     "conversation.session_1[0].text"),
    (lambda r: r["qa"][0].update(category=9), "qa[0].category"),
    (lambda r: r["qa"][0].pop("question"), "qa[0].question"),
    (lambda r: r["conversation"].update(session_1_date_time="someday"),
     "conversation.session_1_date_time"),
])
def test_malformed_records_name_file_record_and_field(tmp_path, mutate, field):
  record = {
      "sample_id": "s1",
      "conversation": {
          "speaker_a": "A", "speaker_b": "B",
          "session_1_date_time": "1:56 pm on 8 May, 2023",
          "session_1": [{"speaker": "A", "dia_id": "D1:1", "text": "hi"}]},
      "qa": [{"question": "q?", "answer": "a", "evidence": ["D1:1"],
              "category": 4}],
  }
  mutate(record)
  path = tmp_path / "bad.json"
  path.write_text(json.dumps([record]))
  with pytest.raises(DatasetError) as info:
    load_locomo(str(path))
  message = str(info.value)
  assert str(path) in message
  assert "record" in message
  assert repr(field) in message


def test_unreadable_file(tmp_path):
  path = tmp_path / "broken.json"
  path.write_text("{not json")
  with pytest.raises(DatasetError, match="broken.json"):
    load_locomo(str(path))
  with pytest.raises(DatasetError, match="cannot read"):
    load_locomo(str(tmp_path / "missing.json"))
