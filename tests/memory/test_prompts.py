import datetime as dt

import jinja2
import pytest

from cmimem_jax.data import Session, Turn
from cmimem_jax.memory import (Action, MemoryBank, MemoryType, Operation,
                               apply_operations, retrieve, retrieve_per_type)
from cmimem_jax.memory.prompt_builder import (PolicyPrompter,
                                              build_agent_prompt,
                                              build_answer_prompt,
                                              build_compression_prompt,
                                              build_judge_prompt,
                                              build_policy_messages)
from cmimem_jax.memory.prompts import TEMPLATES, render_template

SESSION = Session("s", 2, dt.datetime(2023, 5, 8, 13, 56), "8 May 2023", (
    Turn("t1", "user", "user", "I adopted a dog named Rex."),
    Turn("t2", "assistant", "assistant", "Congratulations!")))


def _bank(encoder):
  bank = MemoryBank("u", encoder.dim)
  bank, _ = apply_operations(bank, [
      Operation(MemoryType.CORE, Action.APPEND, ("Name: Ana",)),
      Operation(MemoryType.SEMANTIC, Action.ADD, ("Ana - Pets: cat Tom",))],
      encoder, session_index=0)
  return bank


def test_all_listings_present():
  assert len(TEMPLATES) == 11
  with pytest.raises(jinja2.UndefinedError):
    render_template("judge", question="q")
  with pytest.raises(KeyError, match="unknown template"):
    render_template("nope")


def test_policy_messages(encoder):
  bank = _bank(encoder)
  messages = build_policy_messages(
      bank, SESSION, retrieve_per_type(bank, encoder, SESSION.format()))
  assert [m["role"] for m in messages] == ["system", "user"]
  assert messages[0]["content"].startswith("You are a Memory Manager.")
  assert "CORE:REWRITE|rewritten profile text" in messages[0]["content"]
  user = messages[1]["content"]
  assert user.startswith("[Memory] Core: Name: Ana\n[Memory] Episodic: (none)")
  assert "[Memory] Semantic: \n- Ana - Pets: cat Tom" in user
  assert "[Session #3, 2023-05-08 13:56]\nuser: I adopted a dog named Rex." in user
  assert user.endswith("Output memory operations:")


def _section(messages, name):
  """The `- ` lines of one `[Memory] <name>:` block of the user prompt."""
  user = messages[1]["content"]
  block = user.split(f"[Memory] {name}:")[1].split("\n[")[0]
  return [line for line in block.splitlines() if line.startswith("- ")]


def test_a_prompt_over_its_budget_shows_fewer_retrieved_entries(encoder):
  bank = MemoryBank("u", encoder.dim)
  bank, _ = apply_operations(bank, [
      Operation(MemoryType.CORE, Action.APPEND, ("Name: Ana",))] + [
      Operation(MemoryType.SEMANTIC, Action.ADD, (f"Ana - Pet {i}: dog {i}",))
      for i in range(6)] + [
      Operation(MemoryType.EPISODIC, Action.ADD, (f"Ana walked dog {i}",))
      for i in range(4)], encoder, session_index=0)
  full, shown = PolicyPrompter(encoder, 5).fitted(bank, SESSION)
  assert shown == 5 and full == PolicyPrompter(encoder, 5)(bank, SESSION)
  size = lambda messages: len(messages[1]["content"])  # noqa: E731
  limit = size(full) - 1
  trimmed, shown = PolicyPrompter(
      encoder, 5, lambda m: size(m) <= limit).fitted(bank, SESSION)
  assert 0 < shown < 5 and size(trimmed) <= limit
  # The most entries that fit: one more per type would not.
  assert size(PolicyPrompter(encoder, shown + 1)(bank, SESSION)) > limit
  # Each type keeps its most similar entries, in retrieval order.
  for name in ("Episodic", "Semantic"):
    assert _section(trimmed, name) == _section(full, name)[:shown]
  # Nothing fits: no retrieved entries, the core block and session stay.
  bare, shown = PolicyPrompter(encoder, 5, lambda m: False).fitted(
      bank, SESSION)
  assert shown == 0 and "Name: Ana" in bare[1]["content"]
  assert not _section(bare, "Semantic") and "Rex" in bare[1]["content"]


def test_agent_prompts(encoder):
  bank = _bank(encoder)
  core = build_agent_prompt(MemoryType.CORE, bank, SESSION, [])
  assert "Character Usage: 0.2%" in core and "Name: Ana" in core
  assert '{"operation": "APPEND", "content": "..."}' in core
  episodic = build_agent_prompt(MemoryType.EPISODIC, bank, SESSION, [])
  assert "Conversation Timestamp: 2023-05-08 13:56" in episodic
  semantic = build_agent_prompt(
      MemoryType.SEMANTIC, bank, SESSION,
      retrieve(bank, encoder, "pets", types=[MemoryType.SEMANTIC]))
  assert "- Ana - Pets: cat Tom" in semantic and "{Name} - Career" in semantic
  assert "empty operations array" in build_agent_prompt(
      MemoryType.PROCEDURAL, bank, SESSION, [])


def test_answer_judge_compression(encoder):
  bank = _bank(encoder)
  hits = retrieve(bank, encoder, "pets")
  answer = build_answer_prompt("What pet?", bank, hits, [],
                               dt.datetime(2023, 6, 1))
  assert "1. [session 1] Ana - Pets: cat Tom" in answer  # Date unknown.
  dated = build_answer_prompt("What pet?", bank, hits, [], "now",
                              sessions=(SESSION, SESSION))
  assert "1. [2023-05-08 13:56] Ana - Pets: cat Tom" in dated  # TimeInfo.
  assert "The current date/time is 2023-06-01 00:00." in answer
  assert "Supporting Original Conversations" not in answer
  judge = build_judge_prompt("q?", "gold", "gen")
  assert "Gold answer: gold\nGenerated answer: gen" in judge
  assert judge.endswith('{"label": "CORRECT" | "WRONG"}')
  assert "(5100 chars, limit: 5000)" in build_compression_prompt("x" * 5100)
