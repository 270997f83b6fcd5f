"""Benchmark-independent dialogue records shared by every loader.

A `Dialogue` is one user's history: ordered `Session`s of `Turn`s, plus the
`Question`s asked about it. Loaders map LongMemEval, LoCoMo and
MemoryAgentBench onto these types so that memory building, retrieval and
evaluation never look at a benchmark's raw schema.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any


class DatasetError(ValueError):
  """A dataset file that does not match its benchmark's schema.

  The message always names the file, the record and the field.
  """

  def __init__(self, path: str, record: str | int | None, field: str | None,
               message: str):
    where = [str(path)]
    if record is not None:
      where.append(f"record {record}")
    if field is not None:
      where.append(f"field {field!r}")
    super().__init__(f"{': '.join(where)}: {message}")
    self.path = str(path)
    self.record = record
    self.field = field


# The gold of questions the history cannot answer, as Listing 10 tells the
# answer model to reply and the Listing 11 judge then compares against.
NOT_ANSWERABLE = "Not answerable"


@dataclasses.dataclass(frozen=True)
class Turn:
  """One utterance.

  Attributes:
    turn_id: Unique within the dialogue (LoCoMo `dia_id`, e.g. "D1:3";
      LongMemEval "<session_id>:<index>").
    speaker: Display name ("Caroline", "user", "assistant").
    role: "user" or "assistant" (LoCoMo: speaker_a is "user").
    text: Utterance text (LoCoMo image captions are appended as
      "[shares image: ...]").
    has_answer: LongMemEval's evidence flag, None where the benchmark has none.
  """
  turn_id: str
  speaker: str
  role: str
  text: str
  has_answer: bool | None = None


@dataclasses.dataclass(frozen=True)
class Session:
  """A contiguous exchange with a date, the unit the memory policy sees."""
  session_id: str
  index: int  # 0-based position within the dialogue.
  date: dt.datetime | None
  date_text: str  # The benchmark's original date string ("" if none).
  turns: tuple[Turn, ...]

  def format(self) -> str:
    """Renders the session as `speaker: text` lines (FormatSession, Alg. 1)."""
    return "\n".join(f"{t.speaker}: {t.text}" for t in self.turns)

  def user_turns(self) -> tuple[str, ...]:
    """The texts of the user's turns (role "user")."""
    return tuple(t.text for t in self.turns if t.role == "user")


@dataclasses.dataclass(frozen=True)
class Question:
  """A question about a dialogue, with its gold answer(s).

  Attributes:
    answer: The primary gold answer as text.
    all_answers: Every accepted gold answer (MemoryAgentBench has several;
      elsewhere a 1-tuple of `answer`).
    category: Benchmark category name (LongMemEval `question_type`, LoCoMo
      category name, MemoryAgentBench source).
    evidence: Turn ids that hold the answer, where the benchmark says.
    evidence_sessions: Session ids that hold the answer, where known.
    adversarial_answer: LoCoMo category 5's planted wrong answer (never a
      gold: the gold of those questions is `NOT_ANSWERABLE`).
    is_abstention: The answer is not in the history (LongMemEval `_abs`
      questions, LoCoMo category 5): the right reply is a refusal.
  """
  question_id: str
  question: str
  answer: str
  category: str
  question_date: dt.datetime | None = None
  all_answers: tuple[str, ...] = ()
  evidence: tuple[str, ...] = ()
  evidence_sessions: tuple[str, ...] = ()
  adversarial_answer: str | None = None
  is_abstention: bool = False


@dataclasses.dataclass(frozen=True)
class Dialogue:
  """One user's conversation history and the questions about it."""
  dialogue_id: str
  source: str  # "longmemeval" | "locomo" | "memoryagentbench"
  sessions: tuple[Session, ...]
  questions: tuple[Question, ...]
  metadata: dict[str, Any] = dataclasses.field(default_factory=dict,
                                               compare=False)

  def turn(self, turn_id: str) -> Turn:
    """Returns the turn with this id; raises KeyError if absent."""
    for session in self.sessions:
      for turn in session.turns:
        if turn.turn_id == turn_id:
          return turn
    raise KeyError(turn_id)

  @property
  def num_turns(self) -> int:
    return sum(len(s.turns) for s in self.sessions)
