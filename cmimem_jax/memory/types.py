"""Memory types, actions and operations (paper §2.4 Eq. 2, Table 10)."""

from __future__ import annotations

import dataclasses
import enum


class MemoryType(str, enum.Enum):
  CORE = "core"
  EPISODIC = "episodic"
  SEMANTIC = "semantic"
  PROCEDURAL = "procedural"

  @property
  def dsl_name(self) -> str:
    return self.name


# The slots held as indexed entry lists (core is one text block).
ENTRY_TYPES: tuple[MemoryType, ...] = (
    MemoryType.EPISODIC, MemoryType.SEMANTIC, MemoryType.PROCEDURAL)


class Action(str, enum.Enum):
  APPEND = "APPEND"
  REPLACE = "REPLACE"
  REWRITE = "REWRITE"
  ADD = "ADD"
  UPDATE = "UPDATE"
  MERGE = "MERGE"
  SKIP = "SKIP"


# Eq. 2. Core has no SKIP (paper, note after Listing 6).
ALLOWED_ACTIONS: dict[MemoryType, frozenset[Action]] = {
    MemoryType.CORE: frozenset({Action.APPEND, Action.REPLACE,
                                Action.REWRITE}),
    MemoryType.EPISODIC: frozenset({Action.ADD, Action.UPDATE, Action.MERGE,
                                    Action.SKIP}),
    MemoryType.SEMANTIC: frozenset({Action.ADD, Action.UPDATE, Action.SKIP}),
    MemoryType.PROCEDURAL: frozenset({Action.ADD, Action.UPDATE,
                                      Action.SKIP}),
}

# (min, max) number of fields; None = unbounded. The last field is the new
# text for every writing action; MERGE takes >= 2 olds then the new text;
# SKIP may carry a reason.
FIELD_COUNTS: dict[Action, tuple[int, int | None]] = {
    Action.APPEND: (1, 1),
    Action.REPLACE: (2, 2),
    Action.REWRITE: (1, 1),
    Action.ADD: (1, 1),
    Action.UPDATE: (2, 2),
    Action.MERGE: (3, None),
    Action.SKIP: (0, 1),
}

# Eq. 10 routing: these are scored by net gain rho(new) - rho(old).
UPDATE_LIKE: frozenset[Action] = frozenset(
    {Action.UPDATE, Action.REPLACE, Action.REWRITE})


@dataclasses.dataclass(frozen=True)
class Operation:
  """One memory operation: `TYPE:ACTION|field1|field2...`.

  Attributes:
    memory_type: The slot it acts on.
    action: What it does.
    fields: The DSL fields in order (see `FIELD_COUNTS`).
    line: 0-based line index in the response it was parsed from.
    span: [start, end) character offsets of that line in the response text,
      used to map DSL lines to tokens for attribution weights.
    turn_ids: Source turns, when the producer knows them more precisely than
      "the whole session" (e.g. LoCoMo annotations).
  """
  memory_type: MemoryType
  action: Action
  fields: tuple[str, ...] = ()
  line: int | None = dataclasses.field(default=None, compare=False)
  span: tuple[int, int] | None = dataclasses.field(default=None, compare=False)
  turn_ids: tuple[str, ...] = dataclasses.field(default=(), compare=False)

  @property
  def writes(self) -> bool:
    """Whether the operation writes memory (everything but SKIP)."""
    return self.action is not Action.SKIP

  @property
  def new_text(self) -> str | None:
    """The text written (None for SKIP)."""
    return self.fields[-1] if self.writes and self.fields else None

  @property
  def old_texts(self) -> tuple[str, ...]:
    """Texts referenced as replaced/updated/merged (empty for add-like)."""
    if self.action in (Action.REPLACE, Action.UPDATE, Action.MERGE):
      return self.fields[:-1]
    return ()


def validate_operation(op: Operation) -> str | None:
  """Returns why `op` is malformed, or None when it is well-formed."""
  if op.action not in ALLOWED_ACTIONS[op.memory_type]:
    allowed = "/".join(sorted(a.value for a in ALLOWED_ACTIONS[op.memory_type]))
    return (f"{op.memory_type.dsl_name} does not support {op.action.value} "
            f"(allowed: {allowed})")
  low, high = FIELD_COUNTS[op.action]
  if len(op.fields) < low or (high is not None and len(op.fields) > high):
    expected = str(low) if low == high else (
        f"{low}+" if high is None else f"{low}-{high}")
    return (f"{op.action.value} takes {expected} field(s), got "
            f"{len(op.fields)}")
  for i, field in enumerate(op.fields):
    if not field.strip():
      return f"field {i + 1} is empty"
  return None


@dataclasses.dataclass(frozen=True)
class MemoryEntry:
  """One episodic/semantic/procedural memory with provenance.

  Attributes:
    entry_id: Unique within the bank ("e17").
    memory_type: Its slot.
    text: The memory fragment.
    created_step: Bank step (session counter) that created it.
    updated_step: Step of its last in-place update (semantic/procedural
      UPDATE), else equal to `created_step`.
    session_index: Index of the source session in the dialogue.
    turn_ids: Source dialogue turns (the retrieval index of §3.2 used by
      `LookupChunk`).
    links: Entry ids this one updates (episodic UPDATE) or merges (MERGE).
  """
  entry_id: str
  memory_type: MemoryType
  text: str
  created_step: int
  updated_step: int
  session_index: int
  turn_ids: tuple[str, ...] = ()
  links: tuple[str, ...] = ()
