import pytest

from cmimem_jax.memory import MemoryType, parse, render
from cmimem_jax.memory.annotations import locomo_annotation_operations


def test_every_locomo_session_gives_a_valid_response(locomo_dialogues):
  for dialogue in locomo_dialogues:
    for session in dialogue.sessions:
      ops = locomo_annotation_operations(dialogue, session)
      parsed = parse(render(ops))
      assert parsed.valid, (session.session_id, parsed.errors)
      known = {t.turn_id for t in session.turns}
      semantic = [o for o in ops if o.memory_type is MemoryType.SEMANTIC
                  and o.writes]
      # Observations carry evidence turns of this session (a few LoCoMo
      # annotations cite neighbouring sessions or typos).
      ids = [t for o in semantic for t in o.turn_ids]
      assert sum(t in known for t in ids) >= 0.9 * len(ids)


def test_rejects_other_benchmarks(locomo_dialogues):
  import dataclasses
  other = dataclasses.replace(locomo_dialogues[0], source="longmemeval")
  with pytest.raises(ValueError, match="LoCoMo only"):
    locomo_annotation_operations(other, other.sessions[0])
