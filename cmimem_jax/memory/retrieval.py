"""Retrieval over memory banks (Alg. 1-2, Table 6; SPEC §3.4).

Build time: each agent sees the top-k (20) entries of its type closest to
the session text. QA time: top-k (10) fragments over all types, and
`LookupChunk` maps each episodic and procedural fragment back to the
dialogue turns it came from (§4.1: those entries are the retrieval indices;
semantic entries are abstractions of many turns and pull none).
Banks are per user (`MemoryStore`), so a search never crosses users.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Sequence

from cmimem_jax.data.types import Dialogue, Session, Turn
from cmimem_jax.encoders.base import Encoder
from cmimem_jax.memory.bank import MemoryBank, SearchHit, embed_texts
from cmimem_jax.memory.types import ENTRY_TYPES, MemoryType

# Entry types whose hits pull their source turns (§4.1).
CHUNK_TYPES = (MemoryType.EPISODIC, MemoryType.PROCEDURAL)
# Alg. 2 sets no budget; this one holds ten LongMemEval sessions (~16k
# characters each), so it only guards against pathological banks.
DEFAULT_CHUNK_BUDGET_CHARS = 160_000


def retrieve_per_type(bank: MemoryBank, encoder: Encoder, text: str,
                      k: int = 20) -> dict[MemoryType, list[SearchHit]]:
  """Top-k entries of each entry type by cosine to `text` (Alg. 1 TopK)."""
  query = embed_texts(encoder, [text], kind="query")[0]
  return {t: bank.search(query, k, types=(t,)) for t in ENTRY_TYPES}


def retrieve(bank: MemoryBank, encoder: Encoder, text: str, k: int = 10,
             types: Iterable[MemoryType] = ENTRY_TYPES) -> list[SearchHit]:
  """Top-k fragments over the given types (Alg. 2 FaissSearch)."""
  query = embed_texts(encoder, [text], kind="query")[0]
  return bank.search(query, k, types=tuple(types))


@dataclasses.dataclass(frozen=True)
class Chunk:
  """Source turns of retrieved fragments from one session."""
  session: Session
  turns: tuple[Turn, ...]

  def format(self) -> str:
    header = f"[Session #{self.session.index + 1}, {self.session.date_text}]"
    return "\n".join([header] + [f"{t.speaker}: {t.text}" for t in self.turns])


def lookup_chunks(hits: Sequence[SearchHit], dialogue: Dialogue,
                  budget_chars: int = DEFAULT_CHUNK_BUDGET_CHARS,
                  types: Collection[MemoryType] = CHUNK_TYPES) -> list[Chunk]:
  """`LookupChunk` (Alg. 2): source turns of each hit, within a budget.

  Hits of `types` are visited in rank order; each contributes the turns its
  entry records (or its whole session when it records none), merged per
  session in dialogue order. Turns are added until `budget_chars` of turn
  text is used; a turn that does not fit is skipped. `budget_chars=0`
  returns no chunks (flat memory: the RM ablation of Table 3).

  Returns:
    Chunks ordered by session, turns in dialogue order.
  """
  if budget_chars <= 0:
    return []
  turn_position = {t.turn_id: (s.index, i)
                   for s in dialogue.sessions for i, t in enumerate(s.turns)}
  chosen: dict[int, set[int]] = {}
  used = 0
  for hit in hits:
    entry = hit.entry
    if (entry.memory_type not in types
        or not 0 <= entry.session_index < len(dialogue.sessions)):
      continue
    session = dialogue.sessions[entry.session_index]
    positions = [turn_position[t] for t in entry.turn_ids if t in turn_position]
    if not positions:
      positions = [(session.index, i) for i in range(len(session.turns))]
    for session_index, turn_index in positions:
      selected = chosen.setdefault(session_index, set())
      if turn_index in selected:
        continue
      size = len(dialogue.sessions[session_index].turns[turn_index].text)
      if used + size > budget_chars:
        continue
      selected.add(turn_index)
      used += size
  return [Chunk(dialogue.sessions[s],
                tuple(dialogue.sessions[s].turns[i] for i in sorted(turns)))
          for s, turns in sorted(chosen.items()) if turns]


class MemoryStore:
  """Memory banks keyed by user id; searches are always scoped to one user."""

  def __init__(self, encoder: Encoder):
    self.encoder = encoder
    self._banks: dict[str, MemoryBank] = {}

  def bank(self, user_id: str) -> MemoryBank:
    """The user's bank, created empty on first use."""
    if user_id not in self._banks:
      self._banks[user_id] = MemoryBank(user_id, self.encoder.dim)
    return self._banks[user_id]

  def set_bank(self, bank: MemoryBank) -> None:
    if bank.dim != self.encoder.dim:
      raise ValueError(f"bank {bank.user_id!r} has dim {bank.dim}, encoder "
                       f"has {self.encoder.dim}")
    self._banks[bank.user_id] = bank

  def users(self) -> list[str]:
    return sorted(self._banks)

  def search(self, user_id: str, text: str, k: int = 10,
             types: Iterable[MemoryType] = ENTRY_TYPES) -> list[SearchHit]:
    """Top-k fragments of `user_id`'s bank; unknown users raise KeyError."""
    if user_id not in self._banks:
      raise KeyError(f"no memory bank for user {user_id!r}")
    return retrieve(self._banks[user_id], self.encoder, text, k, types)
