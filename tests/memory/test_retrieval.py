import pytest

from cmimem_jax.data import Dialogue, Session, Turn
from cmimem_jax.memory import (Action, MemoryBank, MemoryStore, MemoryType,
                               Operation, apply_operations, lookup_chunks,
                               retrieve, retrieve_per_type)


def _dialogue():
  turns = lambda s, texts: tuple(  # noqa: E731
      Turn(f"D{s}:{i}", "A", "user", t) for i, t in enumerate(texts, 1))
  return Dialogue("d", "test", (
      Session("s1", 0, None, "day 1", turns(1, ["I adopted a dog named Rex",
                                                "nice", "bye"])),
      Session("s2", 1, None, "day 2", turns(2, ["I brew green tea daily",
                                                "cool"])),
  ), ())


def _bank(encoder):
  bank = MemoryBank("u1", encoder.dim)
  bank, _ = apply_operations(bank, [
      Operation(MemoryType.SEMANTIC, Action.ADD, ("Ana has a dog named Rex",),
                turn_ids=("D1:1",)),
      Operation(MemoryType.EPISODIC, Action.ADD, ("day 1: adopted dog Rex",)),
  ], encoder, session_index=0, turn_ids=("D1:1", "D1:2", "D1:3"))
  bank, _ = apply_operations(bank, [
      Operation(MemoryType.PROCEDURAL, Action.ADD,
                ("How to brew green tea: 1. heat 2. steep",)),
  ], encoder, session_index=1, turn_ids=("D2:1", "D2:2"))
  return bank


def test_retrieve_ranks_by_cosine_and_filters_types(encoder):
  bank = _bank(encoder)
  hits = retrieve(bank, encoder, "green tea brewing", k=3)
  assert hits[0].entry.memory_type is MemoryType.PROCEDURAL
  assert [h.score for h in hits] == sorted([h.score for h in hits], reverse=True)
  per_type = retrieve_per_type(bank, encoder, "dog Rex", k=20)
  assert {t: len(h) for t, h in per_type.items()} == {
      MemoryType.EPISODIC: 1, MemoryType.SEMANTIC: 1, MemoryType.PROCEDURAL: 1}
  only = retrieve(bank, encoder, "dog", k=10, types=[MemoryType.SEMANTIC])
  assert [h.entry.memory_type for h in only] == [MemoryType.SEMANTIC]


def test_lookup_chunks_follow_provenance(encoder):
  bank, dialogue = _bank(encoder), _dialogue()
  semantic = retrieve(bank, encoder, "dog", k=1, types=[MemoryType.SEMANTIC])
  assert lookup_chunks(semantic, dialogue) == []  # Semantic: no source turns.
  (chunk,) = lookup_chunks(semantic, dialogue, types=[MemoryType.SEMANTIC])
  assert [t.turn_id for t in chunk.turns] == ["D1:1"]  # Its own evidence turn.
  hits = retrieve(bank, encoder, "dog tea", k=10)
  chunks = lookup_chunks(hits, dialogue)
  assert [c.session.session_id for c in chunks] == ["s1", "s2"]
  assert [t.turn_id for t in chunks[0].turns] == ["D1:1", "D1:2", "D1:3"]
  assert "[Session #1, day 1]" in chunks[0].format()
  assert lookup_chunks(hits, dialogue, 0) == []  # Flat memory (RM ablation).
  # The budget bounds the turn text included.
  small = lookup_chunks(hits, dialogue, budget_chars=30)
  assert sum(len(t.text) for c in small for t in c.turns) <= 30


def test_store_isolates_users(encoder):
  store = MemoryStore(encoder)
  store.set_bank(_bank(encoder))
  store.bank("u2")
  assert store.users() == ["u1", "u2"]
  assert store.search("u2", "dog", k=5) == []
  assert store.search("u1", "dog", k=5)
  with pytest.raises(KeyError, match="u3"):
    store.search("u3", "dog")
  with pytest.raises(ValueError, match="dim"):
    store.set_bank(MemoryBank("x", encoder.dim + 1))
