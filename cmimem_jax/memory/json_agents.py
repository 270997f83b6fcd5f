"""The four-agent JSON formats (paper Listings 1-4) with LLM-output repairs.

The prompting baselines (Ours-P, MemBuilder-P) and API models answer each
agent prompt with a JSON object. `parse_agent_output` turns one answer into
operations; `combine_agent_outputs` joins the four into a `ParsedResponse`
judged by the same validity rules as the DSL.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping
from typing import Any

from cmimem_jax.memory.dsl import LineError, ParsedResponse, response_errors
from cmimem_jax.memory.types import (Action, MemoryType, Operation,
                                     validate_operation)

_FENCE = re.compile(r"```(?:json|JSON)?\s*\n?(.*?)```", re.DOTALL)
_THINK = re.compile(r"<think>.*?(</think>|$)", re.DOTALL)
_TRAILING_COMMA = re.compile(r",\s*([}\]])")


def _outermost_object(text: str) -> str | None:
  """The first balanced `{...}` in text, respecting JSON strings."""
  start = text.find("{")
  while start >= 0:
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
      char = text[i]
      if in_string:
        if escaped:
          escaped = False
        elif char == "\\":
          escaped = True
        elif char == '"':
          in_string = False
      elif char == '"':
        in_string = True
      elif char == "{":
        depth += 1
      elif char == "}":
        depth -= 1
        if depth == 0:
          return text[start:i + 1]
    start = text.find("{", start + 1)
  return None


def loads_llm_json(text: str) -> Any:
  """Parses a JSON object out of LLM output.

  Repairs: strips `<think>` blocks and code fences, takes the first balanced
  object from surrounding prose, drops trailing commas, and accepts Python
  literal syntax (single quotes, True/None).

  Raises:
    ValueError: when no object can be recovered.
  """
  text = _THINK.sub("", text)
  fenced = _FENCE.search(text)
  if fenced:
    text = fenced.group(1)
  candidate = _outermost_object(text)
  if candidate is None:
    raise ValueError("no JSON object found")
  for attempt in (candidate, _TRAILING_COMMA.sub(r"\1", candidate)):
    try:
      return json.loads(attempt)
    except json.JSONDecodeError:
      pass
  try:
    value = ast.literal_eval(_TRAILING_COMMA.sub(r"\1", candidate))
  except (ValueError, SyntaxError) as e:
    raise ValueError(f"unparseable JSON object: {e}") from e
  if not isinstance(value, dict):
    raise ValueError("not a JSON object")
  return value


def _text(value: Any) -> str:
  return value.strip() if isinstance(value, str) else ""


def _core_operation(obj: Mapping[str, Any]) -> Operation:
  action_name = _text(obj.get("operation")).upper()
  if action_name == Action.REPLACE.value:
    fields = (_text(obj.get("old_text")), _text(obj.get("new_text")))
  else:
    fields = (_text(obj.get("content")),)
  try:
    action = Action(action_name)
  except ValueError:
    action = Action.SKIP  # Rejected below: core has no SKIP.
  return Operation(MemoryType.CORE, action, fields)


def _entry_operation(memory_type: MemoryType, obj: Any) -> Operation | str:
  if not isinstance(obj, Mapping):
    return "operation is not an object"
  action_name = _text(obj.get("action")).upper()
  try:
    action = Action(action_name)
  except ValueError:
    return f"unknown action {action_name!r}"
  if action is Action.SKIP:
    reason = _text(obj.get("reason"))
    fields: tuple[str, ...] = (reason,) if reason else ()
  elif action is Action.ADD:
    fields = (_text(obj.get("memory")),)
  elif action is Action.UPDATE:
    fields = (_text(obj.get("old_memory")), _text(obj.get("new_memory")))
  elif action is Action.MERGE:
    olds = obj.get("old_memories")
    olds = olds if isinstance(olds, list) else []
    fields = tuple(_text(o) for o in olds) + (_text(obj.get("new_memory")),)
  else:
    return f"{memory_type.dsl_name} does not support {action.value}"
  return Operation(memory_type, action, fields)


def parse_agent_output(memory_type: MemoryType, text: str
                       ) -> tuple[list[Operation], list[LineError]]:
  """Parses one agent's JSON answer into operations and errors.

  An empty `operations` array means SKIP (Listing 4 asks for it when a
  session has no procedural content). Never raises.
  """
  name = memory_type.dsl_name
  try:
    obj = loads_llm_json(text if isinstance(text, str) else "")
  except ValueError as e:
    return [], [LineError(None, name, f"{name} agent: {e}")]
  if memory_type is MemoryType.CORE:
    candidates: list[Operation | str] = [_core_operation(obj)]
  else:
    raw_ops = obj.get("operations")
    if not isinstance(raw_ops, list):
      return [], [LineError(None, name, f"{name} agent: no 'operations' list")]
    candidates = ([_entry_operation(memory_type, o) for o in raw_ops]
                  or [Operation(memory_type, Action.SKIP)])
  operations, errors = [], []
  for i, candidate in enumerate(candidates):
    error = (candidate if isinstance(candidate, str)
             else validate_operation(candidate))
    if error:
      errors.append(LineError(i, name, f"{name} agent: {error}"))
    else:
      operations.append(candidate)
  return operations, errors


def combine_agent_outputs(outputs: Mapping[MemoryType, str]) -> ParsedResponse:
  """Joins the four agents' answers into one response (same validity rules).

  A missing agent counts as a missing line for its type.
  """
  operations: list[Operation] = []
  errors: list[LineError] = []
  for memory_type in MemoryType:
    if memory_type in outputs:
      ops, errs = parse_agent_output(memory_type, outputs[memory_type])
      operations += ops
      errors += errs
  errors += response_errors(operations)
  text = json.dumps({t.value: outputs[t] for t in MemoryType if t in outputs})
  return ParsedResponse(text, tuple(operations), tuple(errors))
