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

import json_repair

from cmimem_jax.memory.dsl import LineError, ParsedResponse, response_errors
from cmimem_jax.memory.types import (Action, MemoryType, Operation,
                                     validate_operation)

# Agent answers are a few thousand characters; longer output is a runaway
# generation, and the cap bounds the parse time of any input.
MAX_OUTPUT_CHARS = 64_000
REPAIR_MAX_CHARS = 4_096
_TRAILING_COMMA = re.compile(r",\s*([}\]])")
# What makes a candidate worth `ast.literal_eval` (a full Python parse,
# 45 ms on 60k characters): single quotes or Python's constants.
_PYTHON_LITERAL_HINT = re.compile(r"'|\b(?:True|False|None)\b")
_THINK = re.compile(r"<think>.*?(?:</think>|$)", re.DOTALL)
_FENCE = "```"


def _fenced_block(text: str) -> str | None:
  """The body of the first ``` fence (an optional language tag on its
  first line), found with linear scans (a regex backtracked on long runs
  of newlines)."""
  start = text.find(_FENCE)
  if start < 0:
    return None
  body = start + len(_FENCE)
  newline = text.find("\n", body)
  if newline >= 0 and text[body:newline].strip() in ("json", "JSON", ""):
    body = newline + 1
  end = text.find(_FENCE, body)
  return text[body:end] if end >= 0 else None


def _first_balanced_object(text: str) -> str | None:
  """The balanced `{...}` that starts earliest, respecting JSON strings:
  one pass with a stack of open braces (linear; restarting at every `{`
  was quadratic)."""
  opened: list[int] = []
  best: tuple[int, int] | None = None
  in_string = escaped = False
  for i, char in enumerate(text):
    if in_string:
      if escaped:
        escaped = False
      elif char == "\\":
        escaped = True
      elif char == '"':
        in_string = False
    elif char == '"':
      in_string = bool(opened)
    elif char == "{":
      opened.append(i)
    elif char == "}" and opened:
      start = opened.pop()
      if best is None or start < best[0]:
        best = (start, i + 1)
      if not opened:
        break  # An outermost object closed: nothing can start earlier.
  return None if best is None else text[best[0]:best[1]]


def _repaired(candidate: str) -> Any:
  """`json`, then linear repairs (trailing commas; Python literal syntax),
  then `json_repair` for what is left (unquoted keys, missing quotes) on
  candidates up to `REPAIR_MAX_CHARS`: it is quadratic on some inputs
  (60k characters of `{a: b, ...}` took 29 s)."""
  without_commas = _TRAILING_COMMA.sub(r"\1", candidate)
  try:
    for attempt in (candidate, without_commas):
      try:
        return json.loads(attempt)
      except json.JSONDecodeError:
        pass
    if _PYTHON_LITERAL_HINT.search(candidate):
      try:
        return ast.literal_eval(without_commas)
      except (ValueError, TypeError, SyntaxError, MemoryError):
        pass
    if len(candidate) <= REPAIR_MAX_CHARS:
      return json_repair.loads(candidate)
  except RecursionError:
    raise ValueError("JSON nested too deeply") from None
  raise ValueError(f"unparseable JSON object: {candidate[:80]!r}")


def loads_llm_json(text: str) -> Any:
  """Parses a JSON object out of LLM output, in time linear in its length.

  Strips `<think>` blocks and code fences, takes the first balanced
  object from surrounding prose, and repairs what `json` cannot read
  (`_repaired`).

  Raises:
    ValueError: output over `MAX_OUTPUT_CHARS`, nested too deeply, or no
      non-empty object recoverable.
  """
  if len(text) > MAX_OUTPUT_CHARS:
    raise ValueError(f"output of {len(text)} characters exceeds "
                     f"{MAX_OUTPUT_CHARS}")
  text = _THINK.sub("", text)
  text = _fenced_block(text) or text
  candidate = _first_balanced_object(text)
  if candidate is None:
    raise ValueError("no JSON object found")
  value = _repaired(candidate)
  if not isinstance(value, dict) or not value:
    raise ValueError(f"unparseable JSON object: {candidate[:80]!r}")
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
  except Exception as e:  # noqa: BLE001 - any failure is an invalid answer.
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
