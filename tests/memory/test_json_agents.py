import time

import pytest

from cmimem_jax.memory import (Action, MemoryType, combine_agent_outputs,
                               loads_llm_json, parse_agent_output)


@pytest.mark.parametrize("text", [
    '{"operation": "APPEND", "content": "x"}',
    '```json\n{"operation": "APPEND", "content": "x"}\n```',
    'Sure! Here it is:\n{"operation": "APPEND", "content": "x",}\nThanks.',
    '<think>maybe {"operation": "REWRITE"}</think>{"operation": "APPEND", '
    '"content": "x"}',
    "{'operation': 'APPEND', 'content': 'x'}",
    '{"operation": "APPEND", "content": "x"} {"other": 1}',
])
def test_repairs(text):
  assert loads_llm_json(text) == {"operation": "APPEND", "content": "x"}


def test_braces_inside_strings():
  assert loads_llm_json('x {"a": "}{", "b": [1, 2,],} y') == {
      "a": "}{", "b": [1, 2]}


@pytest.mark.parametrize("text", ["", "no json here", "{broken", "[1, 2]"])
def test_unrecoverable(text):
  with pytest.raises(ValueError):
    loads_llm_json(text)


def test_core_agent():
  ops, errors = parse_agent_output(
      MemoryType.CORE, '{"operation": "REPLACE", "old_text": "17 postcards", '
      '"new_text": "25 postcards"}')
  assert not errors
  assert ops[0].action is Action.REPLACE
  assert ops[0].fields == ("17 postcards", "25 postcards")
  _, errors = parse_agent_output(MemoryType.CORE, '{"operation": "SKIP"}')
  assert "CORE does not support SKIP" in errors[0].message


def test_entry_agents():
  ops, errors = parse_agent_output(MemoryType.EPISODIC, """{"operations": [
      {"action": "ADD", "memory": "2024-03-15: cooking class | Details: pasta"},
      {"action": "UPDATE", "old_memory": "a", "new_memory": "b"},
      {"action": "MERGE", "old_memories": ["a", "b"], "new_memory": "a+b"},
      {"action": "DELETE", "memory": "x"},
      {"action": "ADD", "memory": ""}]}""")
  assert [o.action for o in ops] == [Action.ADD, Action.UPDATE, Action.MERGE]
  # JSON fields may contain the DSL separator: it is plain data here.
  assert ops[0].fields == ("2024-03-15: cooking class | Details: pasta",)
  assert ops[2].fields == ("a", "b", "a+b")
  assert [e.line for e in errors] == [3, 4]
  ops, errors = parse_agent_output(MemoryType.PROCEDURAL, '{"operations": []}')
  assert [o.action for o in ops] == [Action.SKIP] and not errors
  ops, errors = parse_agent_output(
      MemoryType.SEMANTIC, '{"operations": [{"action": "SKIP", "reason": '
      '"common knowledge"}]}')
  assert ops[0].fields == ("common knowledge",)
  _, errors = parse_agent_output(MemoryType.SEMANTIC,
                                 '{"operations": [{"action": "MERGE"}]}')
  assert "does not support MERGE" in errors[0].message
  _, errors = parse_agent_output(MemoryType.SEMANTIC, '{"ops": []}')
  assert "no 'operations' list" in errors[0].message


def test_combine():
  outputs = {
      MemoryType.CORE: '{"operation": "APPEND", "content": "Likes tea"}',
      MemoryType.EPISODIC: '{"operations": [{"action": "ADD", "memory": "e"}]}',
      MemoryType.SEMANTIC: '{"operations": [{"action": "SKIP"}]}',
      MemoryType.PROCEDURAL: '{"operations": []}',
  }
  parsed = combine_agent_outputs(outputs)
  assert parsed.valid and len(parsed.operations) == 4
  del outputs[MemoryType.SEMANTIC]
  parsed = combine_agent_outputs(outputs)
  assert not parsed.valid and "no SEMANTIC line" in parsed.errors[0].message
  outputs[MemoryType.SEMANTIC] = "I cannot help with that."
  assert not combine_agent_outputs(outputs).valid


def test_unquoted_keys_and_python_literals_are_repaired():
  assert loads_llm_json("{operation: 'APPEND', \"content\": 'x', ok: True,}"
                        ) == {"operation": "APPEND", "content": "x",
                              "ok": True}


ADVERSARIAL = {
    "nested brackets": '{"operations": ' + "[" * 1000 + "}",
    "nested objects": '{"a":' * 1000 + "1" + "}" * 1000,
    "open braces": "{" * 20000,
    "fence then newlines": "```json" + "\n" * 20000,
    "unquoted keys": "{" + "a: b, " * 10000 + "}",
    "over the cap": '{"a": "' + "x" * 70000 + '"}',
}


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_adversarial_outputs_are_invalid_quickly_and_never_raise(name):
  started = time.monotonic()
  with pytest.raises(ValueError):
    loads_llm_json(ADVERSARIAL[name])
  parsed = combine_agent_outputs({t: ADVERSARIAL[name] for t in MemoryType})
  assert not parsed.valid and len(parsed.errors) >= len(MemoryType)
  # Was: RecursionError escaping, 14.5 s for 20k "{", 6 s for the fence,
  # 29 s for unquoted keys; linear parsing takes < 0.2 s here for all five
  # calls, so 2 s leaves room for a loaded CI machine.
  assert time.monotonic() - started < 2.0
