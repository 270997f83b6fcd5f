import string

import pytest
from hypothesis import given, settings, strategies as st

from dsl_strategies import broken_text, operations, responses  # noqa: I100

from cmimem_jax.memory import (Action, MemoryType, Operation, clean_field,
                               parse, render)

VALID = """CORE:APPEND|Works as a nurse in Boston
EPISODIC:ADD|2023-05-08: went to a support group
EPISODIC:UPDATE|2023-05-01: started running|2023-05-08: ran a 5K
SEMANTIC:SKIP
PROCEDURAL:ADD|How to brew: 1. boil 2. steep"""


def test_valid_response():
  parsed = parse(VALID)
  assert parsed.valid, parsed.errors
  assert [(o.memory_type, o.action) for o in parsed.operations] == [
      (MemoryType.CORE, Action.APPEND), (MemoryType.EPISODIC, Action.ADD),
      (MemoryType.EPISODIC, Action.UPDATE), (MemoryType.SEMANTIC, Action.SKIP),
      (MemoryType.PROCEDURAL, Action.ADD)]
  update = parsed.operations[2]
  assert update.old_texts == ("2023-05-01: started running",)
  assert update.new_text == "2023-05-08: ran a 5K"
  # Spans point at each op's line in the original text.
  for op in parsed.operations:
    start, end = op.span
    assert VALID[start:end] == VALID.split("\n")[op.line]


def test_think_block_blank_lines_and_case():
  text = "<think>I should\nADD things</think>\n\n" + VALID.lower().replace(
      "core:append", "Core:Append") + "\n\n"
  parsed = parse(text)
  assert parsed.valid, parsed.errors
  assert parsed.operations[0].fields == ("works as a nurse in boston",)
  assert text[slice(*parsed.operations[0].span)].startswith("Core:Append")


def test_merge():
  text = VALID + (
      "\nEPISODIC:MERGE|a|b|a and b timeline")
  parsed = parse(text)
  assert parsed.valid
  merge = parsed.operations[-1]
  assert merge.old_texts == ("a", "b") and merge.new_text == "a and b timeline"


@pytest.mark.parametrize("text,message", [
    ("", "exactly one CORE"),
    (VALID.replace("CORE:APPEND|Works as a nurse in Boston\n", ""),
     "exactly one CORE"),
    (VALID + "\nCORE:APPEND|again", "exactly one CORE"),
    (VALID.replace("SEMANTIC:SKIP", "SEMANTIC:SKIP\nSEMANTIC:ADD|x"),
     "must be the only"),
    (VALID.replace("SEMANTIC:SKIP", "SEMANTIC:SKIP\nSEMANTIC:SKIP"),
     "must be the only"),
    (VALID.replace("SEMANTIC:SKIP\n", ""), "no SEMANTIC line"),
    (VALID.replace("CORE:APPEND", "CORE:SKIP"), "CORE does not support SKIP"),
    (VALID.replace("SEMANTIC:SKIP", "SEMANTIC:MERGE|a|b|c"),
     "does not support MERGE"),
    (VALID + "\nEPISODIC:MERGE|a|b", "MERGE takes 3+"),
    (VALID.replace("CORE:APPEND|Works", "CORE:REPLACE|Works"),
     "REPLACE takes 2"),
    (VALID.replace("SEMANTIC:SKIP", "SEMANTIC:ADD|"), "field 1 is empty"),
    (VALID.replace("SEMANTIC:SKIP", "SEMANTIC:ADD|a|b"), "ADD takes 1"),
    (VALID + "\nHere are my operations:", "not a TYPE:ACTION"),
    (VALID + "\n- EPISODIC:ADD|x", "not a TYPE:ACTION"),
    (VALID + "\nMOOD:ADD|x", "unknown memory type"),
    (VALID + "\nEPISODIC:DELETE|x", "unknown action"),
    ("<think>never closed\n" + VALID, "unterminated"),
])
def test_invalid_responses(text, message):
  parsed = parse(text)
  assert not parsed.valid
  assert any(message in e.message for e in parsed.errors), parsed.errors


def test_per_line_errors_keep_line_numbers():
  parsed = parse(VALID + "\nbogus line")
  (error,) = parsed.errors
  assert error.line == 5 and error.text == "bogus line"
  assert len(parsed.operations) == 5  # Good lines are still returned.


def test_pipe_inside_field_is_a_field_count_error():
  parsed = parse(VALID.replace("CORE:APPEND|Works as a nurse in Boston",
                               "CORE:APPEND|Likes tea | coffee"))
  assert not parsed.valid and "APPEND takes 1" in parsed.errors[0].message


def test_render_rejects_unsafe_fields():
  op = Operation(MemoryType.SEMANTIC, Action.ADD, ("a | b",))
  with pytest.raises(ValueError, match="clean_field"):
    render([op])
  with pytest.raises(ValueError, match="clean_field"):
    render([Operation(MemoryType.SEMANTIC, Action.ADD, ("line\nbreak",))])
  with pytest.raises(ValueError, match="does not support"):
    render([Operation(MemoryType.CORE, Action.SKIP)])
  assert clean_field(" a | b\nc ") == "a / b c"


# --- property tests --------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(st.lists(operations(), max_size=8))
def test_render_parse_round_trip(ops):
  parsed = parse(render(ops))
  assert list(parsed.operations) == ops
  assert not [e for e in parsed.errors if e.line is not None]


_DSL_ALPHABET = string.ascii_letters + string.digits + " :|\n\t<>/-_éß"


@settings(max_examples=300, deadline=None)
@given(st.one_of(
    st.text(max_size=300),
    st.text(alphabet=_DSL_ALPHABET, max_size=300),
    st.lists(st.sampled_from([
        "CORE:APPEND|x", "CORE:REPLACE|a|b", "EPISODIC:SKIP", "SEMANTIC:ADD|y",
        "PROCEDURAL:SKIP", "EPISODIC:MERGE|a|b|c", "<think>", "</think>",
        "CORE:", "|", "", "SEMANTIC:UPDATE|a", "\x00", "CORE:REWRITE|" + "z" * 50,
    ]), max_size=12).map("\n".join),
))
def test_parse_never_raises_on_arbitrary_text(text):
  parsed = parse(text)
  assert isinstance(parsed.errors, tuple)


@settings(max_examples=400, deadline=None)
@given(responses())
def test_validity_is_decided_by_the_listing_6_rules(case):
  """Valid by construction -> parsed valid, with exactly its operations and
  a faithful re-render; broken in one named way -> invalid with an error."""
  text, ops = case
  parsed = parse(text)
  if ops is None:
    assert not parsed.valid and parsed.errors
    return
  assert parsed.valid, parsed.errors
  assert [(o.memory_type, o.action, o.fields) for o in parsed.operations] == [
      (o.memory_type, o.action, o.fields) for o in ops]
  assert parse(render(parsed.operations)).operations == parsed.operations


@settings(max_examples=200, deadline=None)
@given(broken_text())
def test_each_way_of_breaking_a_response_is_caught(case):
  text, way = case
  assert not parse(text).valid, way


def test_parse_non_text():
  assert not parse(None).valid  # type: ignore[arg-type]


def test_a_lone_surrogate_is_an_invalid_line_not_a_crash_later():
  """Model output with a lone surrogate would parse, apply, then fail when
  the bank is written; it is rejected at the line instead."""
  text = VALID.replace("Boston", "Bos\ud800ton")
  parsed = parse(text)
  assert not parsed.valid
  assert [e.message for e in parsed.errors if e.line == 0] == [
      "not valid Unicode text"]


def test_an_oversized_response_is_refused_without_parsing_it():
  import time
  from cmimem_jax.memory.dsl import MAX_RESPONSE_CHARS
  text = "EPISODIC:ADD|x\n" * 100_000
  assert len(text) > MAX_RESPONSE_CHARS
  start = time.perf_counter()
  parsed = parse(text)
  assert time.perf_counter() - start < 0.05
  assert not parsed.valid and "exceeds" in parsed.errors[0].message
