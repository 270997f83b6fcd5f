"""Hypothesis strategies for DSL responses (Listing 6) whose validity is
known by construction: half valid, half broken in one named way."""

from hypothesis import strategies as st

from cmimem_jax.memory import Action, MemoryType, Operation, render
from cmimem_jax.memory.types import ALLOWED_ACTIONS, FIELD_COUNTS

SAFE_TEXT = st.text(
    alphabet=st.characters(blacklist_characters="|\n\r",
                           blacklist_categories=("Cs",)),
    min_size=1, max_size=30).map(str.strip).filter(bool)
ENTRY_TYPES = [t for t in MemoryType if t is not MemoryType.CORE]


@st.composite
def operations(draw, memory_type=None, writing: bool = False):
  """One well-formed operation (of `memory_type`; a write if `writing`)."""
  memory_type = memory_type or draw(st.sampled_from(list(MemoryType)))
  actions = sorted(ALLOWED_ACTIONS[memory_type])
  if writing:
    actions = [a for a in actions if a is not Action.SKIP]
  action = draw(st.sampled_from(actions))
  low, high = FIELD_COUNTS[action]
  count = draw(st.integers(low, high if high is not None else low + 3))
  return Operation(memory_type, action, tuple(
      draw(SAFE_TEXT) for _ in range(count)))


@st.composite
def valid_operations(draw) -> list[Operation]:
  """Exactly one CORE line; per entry type one SKIP or 1-3 writes; in any
  order."""
  ops = [draw(operations(MemoryType.CORE))]
  for memory_type in ENTRY_TYPES:
    if draw(st.booleans()):
      ops.append(Operation(memory_type, Action.SKIP))
    else:
      ops += draw(st.lists(operations(memory_type, writing=True),
                           min_size=1, max_size=3))
  return draw(st.permutations(ops))


BREAKS = ("no CORE line", "two CORE lines", "a type missing",
          "SKIP beside a write", "unknown type", "missing field")


@st.composite
def broken_text(draw) -> tuple[str, str]:
  """A response made invalid in one way; returns (text, the way)."""
  ops = draw(valid_operations())
  way = draw(st.sampled_from(BREAKS))
  if way == "no CORE line":
    ops = [o for o in ops if o.memory_type is not MemoryType.CORE]
  elif way == "two CORE lines":
    ops = ops + [draw(operations(MemoryType.CORE))]
  elif way == "a type missing":
    gone = draw(st.sampled_from(ENTRY_TYPES))
    ops = [o for o in ops if o.memory_type is not gone]
  elif way == "SKIP beside a write":
    memory_type = draw(st.sampled_from(ENTRY_TYPES))
    ops = ops + [Operation(memory_type, Action.SKIP),
                 draw(operations(memory_type, writing=True))]
  text = render(ops)
  if way == "unknown type":
    text += "\nNOTATYPE:ADD|x"
  elif way == "missing field":  # REPLACE needs old and new text.
    lines = text.split("\n")
    core = next(i for i, line in enumerate(lines) if line.startswith("CORE:"))
    lines[core] = "CORE:REPLACE|" + draw(SAFE_TEXT)
    text = "\n".join(lines)
  return text, way


@st.composite
def responses(draw) -> tuple[str, list[Operation] | None]:
  """(text, its operations) for a valid response, (text, None) for a
  broken one, in equal shares."""
  if draw(st.booleans()):
    ops = draw(valid_operations())
    return render(ops), ops
  return draw(broken_text())[0], None
