"""LongMemEval loader (`longmemeval_s_cleaned.json`, `_oracle`, `_m`).

Schema: a list of `{question_id, question_type, question, answer,
question_date, haystack_dates, haystack_session_ids, haystack_sessions
[[{role, content, has_answer?}]], answer_session_ids}`. Each record is one
`Dialogue` with one question (LongMemEval rebuilds the haystack per
question).

Training data uses the same format with one optional extension per record,
`session_qa`: `{session_id: [{question, answer, type?}]}`, the synthetic
per-session QA pairs of the paper's RL split (Table 5).
"""

from __future__ import annotations

import json

from cmimem_jax.data.schema import RecordReader, iter_records, parse_date_field
from cmimem_jax.data.types import Dialogue, Question, Session, Turn

LONGMEMEVAL_TYPES: tuple[str, ...] = (
    "knowledge-update",
    "multi-session",
    "single-session-assistant",
    "single-session-preference",
    "single-session-user",
    "temporal-reasoning",
)


def _load_sessions(reader: RecordReader) -> tuple[Session, ...]:
  session_ids = reader.get_list("haystack_session_ids", str)
  dates = reader.get_list("haystack_dates", str)
  raw_sessions = reader.get_list("haystack_sessions", list)
  if not len(session_ids) == len(dates) == len(raw_sessions):
    reader.fail("haystack_sessions",
                f"{len(raw_sessions)} sessions, {len(session_ids)} ids and "
                f"{len(dates)} dates")
  sessions = []
  for index, (session_id, date_text, raw_turns) in enumerate(
      zip(session_ids, dates, raw_sessions)):
    turns = []
    for turn_index, raw_turn in enumerate(raw_turns):
      turn = reader.nested(f"haystack_sessions[{index}][{turn_index}]",
                           raw_turn)
      role = turn.get("role", str)
      if role not in ("user", "assistant"):
        turn.fail("role", f"expected 'user' or 'assistant', got {role!r}")
      turns.append(Turn(
          turn_id=f"{session_id}:{turn_index}", speaker=role, role=role,
          text=turn.get("content", str),
          has_answer=turn.get("has_answer", bool, required=False)))
    sessions.append(Session(
        session_id=session_id, index=index,
        date=parse_date_field(reader, f"haystack_dates[{index}]", date_text),
        date_text=date_text, turns=tuple(turns)))
  return tuple(sessions)


def _load_session_qa(reader: RecordReader,
                     sessions: tuple[Session, ...]) -> tuple[Question, ...]:
  raw = reader.get("session_qa", dict, required=False, default={})
  by_id = {s.session_id: s for s in sessions}
  questions = []
  for session_id, pairs in raw.items():
    if session_id not in by_id:
      reader.fail(f"session_qa.{session_id}", "no such haystack session")
    if not isinstance(pairs, list):
      reader.fail(f"session_qa.{session_id}", "expected a list of QA pairs")
    for i, raw_pair in enumerate(pairs):
      pair = reader.nested(f"session_qa.{session_id}[{i}]", raw_pair)
      answer = str(pair.get("answer", (str, int, float)))
      questions.append(Question(
          question_id=f"{session_id}:qa{i}",
          question=pair.get("question", str),
          answer=answer,
          category=pair.get("type", str, required=False,
                            default="session-qa"),
          question_date=by_id[session_id].date,
          all_answers=(answer,),
          evidence_sessions=(session_id,)))
  return tuple(questions)


def load_longmemeval(path: str) -> list[Dialogue]:
  """Loads LongMemEval records, one `Dialogue` (one question) per record.

  Turn ids are `<session_id>:<turn index>`; a question's evidence is the
  turns flagged `has_answer` and its evidence sessions `answer_session_ids`.
  Records with `session_qa` (training format) add those QA pairs as further
  questions, each with its session as evidence.

  Raises:
    DatasetError: naming file, record and field on any schema violation.
  """
  dialogues = []
  for reader in iter_records(path, "question_id"):
    question_id = reader.record_id
    sessions = _load_sessions(reader)
    answer = reader.get("answer", (str, int, float))
    # Some releases store non-string answers; keep them readable as text.
    answer_text = answer if isinstance(answer, str) else json.dumps(answer)
    question = Question(
        question_id=question_id,
        question=reader.get("question", str),
        answer=answer_text,
        category=reader.get("question_type", str),
        question_date=parse_date_field(reader, "question_date",
                                       reader.get("question_date", str)),
        all_answers=(answer_text,),
        evidence=tuple(t.turn_id for s in sessions for t in s.turns
                       if t.has_answer),
        evidence_sessions=tuple(
            reader.get_list("answer_session_ids", str, required=False)),
        is_abstention=question_id.endswith("_abs"))
    dialogues.append(Dialogue(
        dialogue_id=question_id, source="longmemeval", sessions=sessions,
        questions=(question,) + _load_session_qa(reader, sessions)))
  return dialogues
