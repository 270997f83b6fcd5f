"""The policy's compact DSL (paper Listing 6): parse and render.

One operation per line, `TYPE:ACTION|field1|field2`. A response is valid when
it has no malformed line, exactly one CORE line (APPEND/REPLACE/REWRITE), and
for each of EPISODIC, SEMANTIC, PROCEDURAL either one or more writing lines
or a single SKIP line. Blank lines are allowed and a leading
`<think>...</think>` block is stripped. `parse` never raises on model output.

`EPISODIC:MERGE|old 1|old 2|...|new` consolidates >= 2 episodic memories
(Listing 2's MERGE in DSL form; Listing 6 itself does not advertise it).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

from cmimem_jax.memory.types import (ALLOWED_ACTIONS, ENTRY_TYPES,
                                     FIELD_COUNTS, Action, MemoryType,
                                     Operation, validate_operation)

SEPARATOR = "|"
_THINK_OPEN = "<think>"
_THINK_CLOSE = "</think>"
_LINE = re.compile(r"^\s*([A-Za-z_]+)\s*:\s*([A-Za-z_]+)\s*(\|.*)?$", re.DOTALL)
_TYPES_BY_NAME = {t.dsl_name: t for t in MemoryType}
_ACTIONS_BY_NAME = {a.value: a for a in Action}


@dataclasses.dataclass(frozen=True)
class LineError:
  """Why a line (or, with `line` None, the response as a whole) is invalid."""
  line: int | None  # 0-based line index in the response.
  text: str
  message: str

  def __str__(self) -> str:
    where = "response" if self.line is None else f"line {self.line + 1}"
    return f"{where}: {self.message}" + (f" ({self.text!r})" if self.text else "")


@dataclasses.dataclass(frozen=True)
class ParsedResponse:
  """Result of `parse`: the well-formed operations and every error found."""
  text: str
  operations: tuple[Operation, ...]
  errors: tuple[LineError, ...]

  @property
  def valid(self) -> bool:
    """Whole-response validity (Listing 6 rules); gates the reward."""
    return not self.errors

  @property
  def writing_operations(self) -> tuple[Operation, ...]:
    return tuple(op for op in self.operations if op.writes)


# Far beyond any response the policy writes (Table 7: 6,000 tokens, about
# 30,000 characters); parsing a longer text would only cost time.
MAX_RESPONSE_CHARS = 200_000


def _strip_think(text: str) -> tuple[int, LineError | None]:
  """Returns where the DSL body starts, skipping a leading think block."""
  stripped = text.lstrip()
  if not stripped.startswith(_THINK_OPEN):
    return 0, None
  start = len(text) - len(stripped)
  close = text.find(_THINK_CLOSE, start)
  if close < 0:
    return len(text), LineError(None, "", "unterminated <think> block")
  return close + len(_THINK_CLOSE), None


def _parse_line(line: str) -> Operation | str:
  """Parses one non-blank line into an operation, or returns the error."""
  try:
    line.encode("utf-8")
  except UnicodeEncodeError:  # A lone surrogate: no file can store it.
    return "not valid Unicode text"
  match = _LINE.match(line)
  if not match:
    return "not a TYPE:ACTION|field line"
  type_name, action_name, rest = match.groups()
  memory_type = _TYPES_BY_NAME.get(type_name.upper())
  if memory_type is None:
    return f"unknown memory type {type_name!r}"
  action = _ACTIONS_BY_NAME.get(action_name.upper())
  if action is None:
    return f"unknown action {action_name!r}"
  fields = tuple(f.strip() for f in rest.split(SEPARATOR)[1:]) if rest else ()
  op = Operation(memory_type, action, fields)
  return validate_operation(op) or op


def response_errors(operations: Iterable[Operation]) -> list[LineError]:
  """Checks the per-type counts that make a whole response valid."""
  by_type: dict[MemoryType, list[Operation]] = {t: [] for t in MemoryType}
  for op in operations:
    by_type[op.memory_type].append(op)
  errors = []
  if len(by_type[MemoryType.CORE]) != 1:
    errors.append(LineError(None, "", "expected exactly one CORE line, got "
                            f"{len(by_type[MemoryType.CORE])}"))
  for memory_type in ENTRY_TYPES:
    ops = by_type[memory_type]
    skips = sum(not op.writes for op in ops)
    name = memory_type.dsl_name
    if not ops:
      errors.append(LineError(None, "", f"no {name} line (use {name}:SKIP "
                              "when nothing applies)"))
    elif skips and (skips > 1 or len(ops) > 1):
      errors.append(LineError(None, "", f"{name}:SKIP must be the only "
                              f"{name} line"))
  return errors


def parse(text: str) -> ParsedResponse:
  """Parses a policy response into operations and per-line errors.

  Args:
    text: The raw model output.

  Returns:
    A `ParsedResponse` whose `operations` are the well-formed lines (with
    their line index and character span in `text`) and whose `errors` list
    every malformed line plus response-level violations. Never raises.
  """
  if not isinstance(text, str):
    return ParsedResponse("", (), (LineError(None, "", "response is not text"),))
  if len(text) > MAX_RESPONSE_CHARS:
    return ParsedResponse(text, (), (LineError(
        None, "", f"response of {len(text)} characters exceeds "
        f"{MAX_RESPONSE_CHARS}"),))
  body_start, think_error = _strip_think(text)
  errors = [think_error] if think_error else []
  operations = []
  offset = body_start
  for line_index, line in enumerate(text[body_start:].split("\n")):
    span = (offset, offset + len(line))
    offset = span[1] + 1
    if not line.strip():
      continue
    result = _parse_line(line)
    if isinstance(result, str):
      errors.append(LineError(line_index, line.strip()[:200], result))
    else:
      operations.append(dataclasses.replace(result, line=line_index, span=span))
  errors.extend(response_errors(operations))
  return ParsedResponse(text, tuple(operations), tuple(errors))


def clean_field(text: str) -> str:
  """Makes arbitrary text usable as one DSL field.

  The separator and line breaks cannot appear inside a field (the prompt
  tells the model so); they become " / " and spaces.
  """
  text = text.replace(SEPARATOR, " / ")
  return " ".join(text.split())


def render(operations: Iterable[Operation]) -> str:
  """Renders operations as DSL lines; `parse(render(ops)).operations == ops`.

  Raises:
    ValueError: if an operation is malformed or a field contains the
      separator, a line break, or surrounding whitespace (use `clean_field`).
  """
  lines = []
  for op in operations:
    error = validate_operation(op)
    if error:
      raise ValueError(f"cannot render {op}: {error}")
    for field in op.fields:
      if (SEPARATOR in field or "\n" in field or "\r" in field
          or field != field.strip()):
        raise ValueError(f"field {field!r} is not DSL-safe; pass it through "
                         "clean_field() first")
    head = f"{op.memory_type.dsl_name}:{op.action.value}"
    lines.append(SEPARATOR.join((head,) + op.fields))
  return "\n".join(lines)



def rendered_response(operations: Iterable[Operation]) -> ParsedResponse:
  """The parsed response a model writing `operations` would give, each
  operation keeping its provenance (`turn_ids`, which the DSL text does
  not carry; each keeps its line and span in the text): what a model-free
  policy (annotations, extractive) returns.

  Raises:
    ValueError: as `render`.
  """
  operations = tuple(operations)
  response = parse(render(operations))
  return dataclasses.replace(response, operations=tuple(
      dataclasses.replace(parsed, turn_ids=op.turn_ids)
      for parsed, op in zip(response.operations, operations)))


# A DSL field: non-empty, no separator or line break, not starting with
# blank space (so `field.strip()` is never empty). Unbounded on purpose:
# bounded repeats blow up the token automaton (SPEC §3.3); lengths are
# bounded by the sampler's token budget instead.
_FIELD_REGEX = r"[^|\n\r\t ][^|\n\r]*"


def response_regex() -> str:
  """A regex whose every match parses as a valid response: one CORE line,
  then per entry type (in Listing 6's order) writing lines or one SKIP,
  each line ending in a newline.

  Derived from `ALLOWED_ACTIONS` / `FIELD_COUNTS`; the input of
  grammar-constrained decoding (`sampling.TokenConstraint`).
  """
  def line(memory_type: MemoryType, action: Action) -> str:
    low, high = FIELD_COUNTS[action]
    if action == Action.SKIP:
      low = high = 0
    fields = rf"\|{_FIELD_REGEX}" * low
    if high is None:
      fields += rf"(\|{_FIELD_REGEX})*"
    return f"{memory_type.dsl_name}:{action.value}{fields}"

  def writes(memory_type: MemoryType) -> str:
    return "|".join(line(memory_type, a) for a in sorted(
        ALLOWED_ACTIONS[memory_type], key=lambda a: a.value)
                    if a != Action.SKIP)

  parts = [rf"({writes(MemoryType.CORE)})\n"]
  for memory_type in ENTRY_TYPES:
    parts.append(rf"((({writes(memory_type)})\n)+|"
                 rf"{line(memory_type, Action.SKIP)}\n)")
  return "".join(parts)
