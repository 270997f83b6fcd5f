"""A reference memory policy read from benchmark annotations.

LoCoMo ships human-checked per-session `observation`s (facts with the turn
ids they come from) and `event_summary`s. Turned into DSL operations they
give a deterministic, model-free policy: the demo and tests use it to drive
the real parse -> Apply -> retrieval -> reward path on real data, and it is
a sanity baseline for learned policies.
"""

from __future__ import annotations

from cmimem_jax.data.types import Dialogue, Session
from cmimem_jax.memory.dsl import clean_field
from cmimem_jax.memory.types import ENTRY_TYPES, Action, MemoryType, Operation


def locomo_annotation_operations(dialogue: Dialogue,
                                 session: Session) -> list[Operation]:
  """DSL operations for one LoCoMo session from its annotations.

  CORE appends the session's first observation about the first speaker who
  has one; EPISODIC adds the dated event summaries; SEMANTIC adds every
  observation (with its evidence turns); PROCEDURAL skips. A type without
  content gets SKIP, so the response is always valid.

  Raises:
    ValueError: if the dialogue is not LoCoMo or lacks annotations.
  """
  if dialogue.source != "locomo":
    raise ValueError(f"annotations exist for LoCoMo only, not "
                     f"{dialogue.source!r}")
  number = session.session_id.rsplit("_", 1)[-1]
  observations = dialogue.metadata.get("observation", {}).get(
      f"session_{number}_observation", {})
  events = dialogue.metadata.get("event_summary", {}).get(
      f"events_session_{number}", {})
  if not observations and not events:
    raise ValueError(f"{dialogue.dialogue_id} session {number} has no "
                     "observation or event_summary annotations")
  date = session.date.strftime("%Y-%m-%d") if session.date else "unknown"
  ops: list[Operation] = []
  facts = [(speaker, text, evidence) for speaker, items in observations.items()
           for text, evidence, *_ in items]
  if facts:
    speaker, text, evidence = facts[0]
    ops.append(Operation(MemoryType.CORE, Action.APPEND,
                         (clean_field(f"{speaker}: {text}"),),
                         turn_ids=_evidence_ids(evidence)))
  else:
    ops.append(Operation(MemoryType.CORE, Action.APPEND,
                         (clean_field(f"Talked on {date}."),)))
  for speaker, items in events.items():
    if speaker == "date":
      continue
    ops += [Operation(MemoryType.EPISODIC, Action.ADD,
                      (clean_field(f"{date}: {event}"),)) for event in items]
  ops += [Operation(MemoryType.SEMANTIC, Action.ADD, (clean_field(text),),
                    turn_ids=_evidence_ids(evidence))
          for _, text, evidence in facts]
  present = {op.memory_type for op in ops}
  ops += [Operation(t, Action.SKIP) for t in ENTRY_TYPES if t not in present]
  return ops


def _evidence_ids(evidence: object) -> tuple[str, ...]:
  items = evidence if isinstance(evidence, list) else [evidence]
  return tuple(str(e).strip() for item in items
               for e in str(item).replace(";", ",").split(",") if str(e).strip())
