"""LoCoMo (`locomo10.json`) loader.

Schema: a list of `{sample_id, conversation{speaker_a, speaker_b, session_N:
[{speaker, dia_id, text, blip_caption?}], session_N_date_time}, qa[{question,
answer | adversarial_answer, evidence, category}], observation?, event_summary?}`.
"""

from __future__ import annotations

import datetime as dt
import re
from typing import Any

from cmimem_jax.data.schema import RecordReader, iter_records, parse_date_field
from cmimem_jax.data.types import (NOT_ANSWERABLE, Dialogue, Question, Session,
                                   Turn)

LOCOMO_CATEGORIES: dict[int, str] = {
    1: "multi-hop",
    2: "temporal",
    3: "open-domain",
    4: "single-hop",
    5: "adversarial",
}

_SESSION_KEY = re.compile(r"^session_(\d+)$")


def _session_numbers(conversation: dict[str, Any]) -> list[int]:
  return sorted(int(m.group(1)) for key in conversation
                if (m := _SESSION_KEY.match(key)))


def _load_turn(turn: RecordReader, speaker_a: str) -> Turn:
  speaker = turn.get("speaker", str)
  text = turn.get("text", str)
  caption = turn.get("blip_caption", str, required=False)
  if caption:
    text = f"{text} [shares image: {caption}]"
  return Turn(turn_id=turn.get("dia_id", str), speaker=speaker,
              role="user" if speaker == speaker_a else "assistant", text=text)


def _load_question(qa: RecordReader, index: int, sample_id: str,
                   question_date: dt.datetime) -> Question:
  category_id = qa.get("category", int)
  if category_id not in LOCOMO_CATEGORIES:
    qa.fail("category", f"unknown category {category_id!r}")
  answer = qa.get("answer", (str, int, float), required=False)
  adversarial = qa.get("adversarial_answer", (str, int, float), required=False)
  unanswerable = LOCOMO_CATEGORIES[category_id] == "adversarial"
  if unanswerable:
    # Category 5 asks about something never said; `adversarial_answer` is
    # the planted wrong answer, so a judge must see the refusal as gold.
    answer = NOT_ANSWERABLE
  elif answer is None:
    qa.fail("answer", "missing")
  evidence = qa.get_list("evidence", str, required=False)
  return Question(
      question_id=f"{sample_id}:q{index}",
      question=qa.get("question", str),
      answer=str(answer),
      category=LOCOMO_CATEGORIES[category_id],
      question_date=question_date,
      all_answers=(str(answer),),
      # A few evidence items hold several ids ("D8:6; D9:17"): split them so
      # recall metrics can match single turn ids.
      evidence=tuple(part.strip() for item in evidence
                     for part in re.split(r"[;,]", item) if part.strip()),
      adversarial_answer=None if adversarial is None else str(adversarial),
      is_abstention=unanswerable,
  )


def load_locomo(path: str) -> list[Dialogue]:
  """Loads LoCoMo conversations.

  Every `session_N` key present is loaded in numeric order (numbering has
  gaps in some releases). Turn ids are LoCoMo's `dia_id`s; speaker_a is
  given role "user". The last session date is used as every question's date
  (LoCoMo has none of its own).

  Args:
    path: `locomo10.json` or a file with the same schema.

  Returns:
    One `Dialogue` per sample, questions in file order.

  Raises:
    DatasetError: naming file, record and field on any schema violation.
  """
  dialogues = []
  for reader in iter_records(path, "sample_id"):
    sample_id = reader.record_id
    conversation = reader.get("conversation", dict)
    conv = reader.nested("conversation", conversation)
    speaker_a = conv.get("speaker_a", str)
    numbers = _session_numbers(conversation)
    if not numbers:
      reader.fail("conversation", "no session_N keys")
    sessions = []
    for position, number in enumerate(numbers):
      key = f"session_{number}"
      date_key = f"{key}_date_time"
      date_text = conv.get(date_key, str)
      turns_raw = conv.get(key, list)
      turns = tuple(
          _load_turn(conv.nested(f"{key}[{i}]", t), speaker_a)
          for i, t in enumerate(turns_raw))
      sessions.append(Session(
          session_id=f"{sample_id}:{key}", index=position,
          date=parse_date_field(conv, date_key, date_text),
          date_text=date_text, turns=turns))
    questions = tuple(
        _load_question(reader.nested(f"qa[{i}]", q), i, sample_id,
                       sessions[-1].date)
        for i, q in enumerate(reader.get_list("qa", dict)))
    dialogues.append(Dialogue(
        dialogue_id=sample_id, source="locomo", sessions=tuple(sessions),
        questions=questions,
        metadata={
            "speaker_a": speaker_a,
            "speaker_b": conv.get("speaker_b", str),
            "observation": reader.get("observation", dict, required=False,
                                      default={}),
            "event_summary": reader.get("event_summary", dict, required=False,
                                        default={}),
        }))
  return dialogues

