"""MemoryAgentBench loader (parquet, JSON or JSON Lines rows).

Schema per row: `{context: str, questions: [str], answers: [[str]],
metadata: {source, qa_pair_ids?, ...}}`. The long `context` is cut into
chunks that are fed to the memory manager as sessions, one turn each, the
way the benchmark streams it to agents.
"""

from __future__ import annotations

import os
from typing import Any

from cmimem_jax import storage
from cmimem_jax.data.schema import RecordReader, read_json
from cmimem_jax.data.types import DatasetError, Dialogue, Question, Session, Turn

DEFAULT_CHUNK_CHARS = 4096


def chunk_text(text: str, max_chars: int) -> list[str]:
  """Greedily packs whitespace-separated words into chunks of <= max_chars.

  A word longer than `max_chars` is split hard. Joining the chunks with
  single spaces gives the text with its whitespace collapsed.
  """
  if max_chars <= 0:
    raise ValueError(f"max_chars must be positive, got {max_chars}")
  chunks: list[str] = []
  current: list[str] = []
  size = 0
  for word in text.split():
    while len(word) > max_chars:
      if current:
        chunks.append(" ".join(current))
        current, size = [], 0
      chunks.append(word[:max_chars])
      word = word[max_chars:]
    if current and size + 1 + len(word) > max_chars:
      chunks.append(" ".join(current))
      current, size = [], 0
    size += len(word) + (1 if current else 0)
    current.append(word)
  if current:
    chunks.append(" ".join(current))
  return chunks


def _read_rows(path: str) -> list[Any]:
  if os.path.splitext(path)[1].lower() == ".parquet":
    try:
      import pyarrow.parquet as pq  # Optional: only parquet inputs need it.
    except ImportError as e:
      raise DatasetError(path, None, None,
                         "reading parquet needs pyarrow (pip install pyarrow)"
                         ) from e
    try:
      with storage.path(path).open("rb") as f:
        return pq.read_table(f).to_pylist()
    except storage.StorageError:
      raise
    except Exception as e:  # pyarrow raises many types for bad files.
      raise DatasetError(path, None, None, f"unreadable parquet: {e}") from e
  rows = read_json(path)
  if isinstance(rows, dict):  # A single row, or {"data": [...]} exports.
    rows = rows.get("data", [rows])
  if not isinstance(rows, list):
    raise DatasetError(path, None, None, "expected a list of rows")
  return rows


def load_memoryagentbench(path: str,
                          chunk_chars: int = DEFAULT_CHUNK_CHARS
                          ) -> list[Dialogue]:
  """Loads MemoryAgentBench rows, one `Dialogue` per row.

  Args:
    path: A `.parquet`, `.json` or `.jsonl` file of rows.
    chunk_chars: Maximum characters per context chunk (one session each).

  Returns:
    Dialogues whose questions carry every gold answer in `all_answers` (the
    metrics take the max over them) and `metadata.source` as category.

  Raises:
    DatasetError: naming file, record and field on any schema violation.
  """
  dialogues = []
  for row_index, raw in enumerate(_read_rows(path)):
    reader = RecordReader(path, row_index, raw)
    context = reader.get("context", str)
    questions = reader.get_list("questions", str)
    answers = reader.get_list("answers", (list, str))
    if len(questions) != len(answers):
      reader.fail("answers", f"{len(answers)} answer lists for "
                  f"{len(questions)} questions")
    metadata = reader.get("metadata", dict, required=False, default={}) or {}
    meta = reader.nested("metadata", metadata)
    source = meta.get("source", str, required=False, default="unknown")
    qa_ids = meta.get("qa_pair_ids", list, required=False, default=None)
    if qa_ids is not None and len(qa_ids) != len(questions):
      meta.fail("qa_pair_ids", f"{len(qa_ids)} ids for {len(questions)} "
                "questions")
    if qa_ids is not None and len(set(map(str, qa_ids))) != len(qa_ids):
      meta.fail("qa_pair_ids", "repeats an id")
    dialogue_id = f"{source}:{row_index}"
    chunks = chunk_text(context, chunk_chars)
    if not chunks:
      reader.fail("context", "empty")
    sessions = tuple(
        Session(session_id=f"{dialogue_id}:chunk{i}", index=i, date=None,
                date_text="",
                turns=(Turn(turn_id=f"{dialogue_id}:chunk{i}", speaker="user",
                            role="user", text=chunk),))
        for i, chunk in enumerate(chunks))
    parsed_questions = []
    for i, (question, golds) in enumerate(zip(questions, answers)):
      golds = [golds] if isinstance(golds, str) else golds
      if not golds or not all(isinstance(g, (str, int, float)) for g in golds):
        reader.fail(f"answers[{i}]", "expected a non-empty list of strings")
      golds = tuple(str(g) for g in golds)
      parsed_questions.append(Question(
          # Prefixed: rows of different sources reuse qa_pair_ids.
          question_id=(f"{dialogue_id}:{qa_ids[i]}" if qa_ids
                       else f"{dialogue_id}:q{i}"),
          question=question, answer=golds[0], category=source,
          all_answers=golds))
    dialogues.append(Dialogue(
        dialogue_id=dialogue_id, source="memoryagentbench", sessions=sessions,
        questions=tuple(parsed_questions), metadata=dict(metadata)))
  return dialogues
