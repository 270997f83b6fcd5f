"""What in a session's text could become a memory: the candidate
fragments of Eq. 14 (|C_t|) and the user's statements that the
semantic-SKIP judgement weighs (SPEC §4.4)."""

from __future__ import annotations

import re
from collections.abc import Iterable

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")
# Clauses: sentence ends, commas and semicolons ("I'm vegetarian, any
# dinner ideas?" states one thing and asks another).
_CLAUSE_END = re.compile(r"(?<=[.!?,;])\s+|\n+")
# Fewer words carry no fact worth a memory ("ok", "thanks a lot!").
MIN_FRAGMENT_WORDS = 4


def candidate_fragments(turn_texts: Iterable[str]) -> int:
  """|C_t| of Eq. 14: the session's sentences of at least
  `MIN_FRAGMENT_WORDS` words, each a candidate memory fragment."""
  return sum(len(sentence.split()) >= MIN_FRAGMENT_WORDS
             for text in turn_texts for sentence in _SENTENCE_END.split(text))


def _statements(text: str, boundary: re.Pattern[str]) -> list[str]:
  return [part.strip() for part in boundary.split(text)
          if len(part.split()) >= MIN_FRAGMENT_WORDS
          and not part.rstrip().endswith("?")]


def user_statements(user_turns: Iterable[str]) -> list[str]:
  """The clauses of the user's turns that state something (at least
  `MIN_FRAGMENT_WORDS` words, not a question): what user-specific
  knowledge a session can hold. A session of questions only ("What is the
  capital of Australia?") states nothing about the user (App. B: semantic
  SKIP for common knowledge)."""
  return [clause for text in user_turns
          for clause in _statements(text, _CLAUSE_END)]


def stated_sentences(text: str) -> list[str]:
  """The whole sentences of `text` that state something (the same test
  as `user_statements`, split at sentence ends only, so that each reads
  on its own)."""
  return _statements(text, _SENTENCE_END)
