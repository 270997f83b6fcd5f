import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dsl_strategies import responses  # noqa: I100

from cmimem_jax.memory import (Action, CoreConfig, MemoryBank, MemoryEditors,
                               MemoryType, Operation, apply_operations, apply_response,
                               keep_recent_lines, parse)

C, E, S, P = (MemoryType.CORE, MemoryType.EPISODIC, MemoryType.SEMANTIC,
              MemoryType.PROCEDURAL)


def op(memory_type, action, *fields, turn_ids=()):
  return Operation(memory_type, Action(action), tuple(fields),
                   turn_ids=tuple(turn_ids))


def apply(bank, ops, encoder, **kwargs):
  kwargs.setdefault("session_index", 0)
  return apply_operations(bank, ops, encoder, **kwargs)


@pytest.fixture
def bank(encoder):
  bank = MemoryBank("u1", encoder.dim)
  bank, _ = apply(bank, [
      op(C, "APPEND", "Name: Ana"),
      op(E, "ADD", "2023-05-01: Ana started running"),
      op(S, "ADD", "Ana - Pets: has a dog named Rex"),
      op(P, "ADD", "How to brew tea: 1. boil 2. steep"),
  ], encoder, session_index=0, turn_ids=("t1", "t2"))
  return bank


def test_core_append_replace_rewrite(bank, encoder):
  new, report = apply(bank, [op(C, "APPEND", "Lives in Oslo")], encoder)
  assert new.core == "Name: Ana\nLives in Oslo" and not report.flags
  new, report = apply(new, [op(C, "REPLACE", "Oslo", "Bergen")], encoder)
  assert new.core == "Name: Ana\nLives in Bergen"
  new, report = apply(new, [op(C, "REPLACE", "Paris", "Rome")], encoder)
  assert new.core == "Name: Ana\nLives in Bergen"
  assert report.applied and "not found (no-op)" in report.flags[0]
  new, _ = apply(new, [op(C, "REWRITE", "x" * 20)], encoder,
                 core_config=CoreConfig(cap_chars=10, compress_trigger=1.0,
                                        compress_target_chars=10))
  assert new.core == "x" * 10  # Cut to the cap.


def test_core_replace_first_occurrence_only(encoder):
  bank = MemoryBank("u", encoder.dim)
  bank.core = "cat cat"
  new, _ = apply(bank, [op(C, "REPLACE", "cat", "dog")], encoder)
  assert new.core == "dog cat"


def test_core_compression(encoder):
  config = CoreConfig(cap_chars=100, compress_trigger=0.9,
                      compress_target_chars=40)
  bank = MemoryBank("u", encoder.dim)
  bank.core = "\n".join(f"line {i:02d} xxxxxxxx" for i in range(5))  # 84 chars
  new, report = apply(bank, [op(C, "APPEND", "line 05 xxxxxxxx")], encoder,
                      core_config=config)
  assert report.compressed
  assert new.core == "line 04 xxxxxxxx\nline 05 xxxxxxxx"
  # An LLM compressor is used when given; its failure falls back and counts.
  new, report = apply(bank, [op(C, "APPEND", "line 05 xxxxxxxx")], encoder,
                      core_config=config,
                      editors=MemoryEditors(compress_core=lambda text: "short"))
  assert new.core == "short" and report.compression_failures == 0

  def broken(text):
    raise TimeoutError("endpoint down")
  new, report = apply(bank, [op(C, "APPEND", "line 05 xxxxxxxx")], encoder,
                      core_config=config,
                      editors=MemoryEditors(compress_core=broken))
  assert report.compression_failures == 1
  assert new.core == "line 04 xxxxxxxx\nline 05 xxxxxxxx"
  # Below the trigger nothing happens.
  _, report = apply(bank, [op(C, "APPEND", "x")], encoder, core_config=config)
  assert not report.compressed


def test_keep_recent_lines():
  assert keep_recent_lines("a\nbb\nccc", 6) == "bb\nccc"
  assert keep_recent_lines("a\nbb\nccc", 2) == "cc"


def test_episodic_add_update_merge_are_append_only(bank, encoder):
  (first,) = bank.entries(E)
  new, report = apply(bank, [
      op(E, "UPDATE", "2023-05-01: Ana started running",
         "2023-05-08: Ana ran 5K"),
      op(E, "ADD", "2023-05-09: Ana bought shoes"),
  ], encoder, session_index=1, turn_ids=("t9",))
  entries = new.entries(E)
  assert [e.text for e in entries] == [
      "2023-05-01: Ana started running", "2023-05-08: Ana ran 5K",
      "2023-05-09: Ana bought shoes"]
  assert entries[1].links == (first.entry_id,)
  assert entries[1].session_index == 1 and entries[1].turn_ids == ("t9",)
  assert report.entry_ids == [entries[1].entry_id, entries[2].entry_id]
  merged, report = apply(new, [op(
      E, "MERGE", "2023-05-01: Ana started running", "2023-05-08: Ana ran 5K",
      "2023-05-01 to 2023-05-08: Ana's running")], encoder)
  timeline = merged.entries(E)[-1]
  assert len(merged.entries(E)) == 4  # The olds stay.
  assert timeline.links == (entries[0].entry_id, entries[1].entry_id)
  assert not report.flags


def test_episodic_update_without_match_is_flagged(bank, encoder):
  new, report = apply(bank, [op(E, "UPDATE", "never stored", "new")], encoder)
  assert new.entries(E)[-1].links == () and "no memory matches" in report.flags[0]


@pytest.mark.parametrize("memory_type", [S, P])
def test_semantic_procedural_update_in_place(bank, encoder, memory_type):
  (old,) = bank.entries(memory_type)
  new, report = apply(bank, [op(memory_type, "UPDATE", old.text,
                                "completely different words here")],
                      encoder, session_index=3, turn_ids=("t7",))
  (updated,) = new.entries(memory_type)
  assert updated.entry_id == old.entry_id
  assert updated.text == "completely different words here"
  assert updated.updated_step == new.step and updated.created_step == old.created_step
  assert updated.turn_ids == ("t1", "t2", "t7")
  assert np.allclose(new.stores[memory_type].vectors[0],
                     encoder.encode([updated.text])[0])
  assert report.entry_ids == [old.entry_id]


def test_semantic_update_cosine_match(encoder):
  bank = MemoryBank("u", encoder.dim)
  text = "Ana - Pets: has a dog named Rex and a cat named Tom"
  bank, _ = apply(bank, [op(S, "ADD", text)], encoder)
  # Not verbatim, but the same words: cosine >= 0.9.
  variant = text.lower() + "."
  assert float(encoder.encode([variant])[0] @ encoder.encode([text])[0]) >= 0.9
  new, report = apply(bank, [op(S, "UPDATE", variant, "Ana - Pets: dog Rex")],
                      encoder)
  assert [e.text for e in new.entries(S)] == ["Ana - Pets: dog Rex"]
  # Far below the threshold: becomes an ADD, flagged.
  new, report = apply(bank, [op(S, "UPDATE", "unrelated words", "Bob - Job")],
                      encoder)
  assert [e.text for e in new.entries(S)] == [text, "Bob - Job"]
  assert "no memory matches" in report.flags[0]


def test_skip_does_nothing(bank, encoder):
  new, report = apply(bank, [op(E, "SKIP"), op(S, "SKIP", "common knowledge")],
                      encoder)
  assert new.entries() == bank.entries() and new.core == bank.core
  assert new.step == bank.step + 1 and report.entry_ids == [None, None]


def test_invalid_operation_rejects_everything(bank, encoder):
  before = bank.copy()
  new, report = apply(bank, [op(S, "ADD", "fine"), op(C, "SKIP")], encoder)
  assert new is bank and not report.applied
  assert "CORE does not support SKIP" in report.errors[0]
  assert bank == before


def test_input_bank_is_never_mutated(bank, encoder):
  before = bank.copy()
  apply(bank, [op(C, "REWRITE", "new"), op(S, "UPDATE",
                                           "Ana - Pets: has a dog named Rex",
                                           "x y z"), op(E, "ADD", "e")], encoder)
  assert bank == before


def test_encoder_failure_leaves_bank_intact(bank, encoder):
  class Broken:
    dim = encoder.dim

    def encode(self, texts, kind="document"):
      return np.full((len(texts), self.dim), np.nan, np.float32)
  before = bank.copy()
  with pytest.raises(ValueError, match="NaN"):
    apply(bank, [op(S, "ADD", "x")], Broken())
  assert bank == before


def test_apply_response_gate(bank, encoder):
  invalid = parse("CORE:APPEND|x\nEPISODIC:ADD|y")
  new, report = apply_response(bank, invalid, encoder, session_index=1)
  assert new is bank and not report.applied and report.errors
  valid = parse("CORE:APPEND|x\nEPISODIC:ADD|y\nSEMANTIC:SKIP\nPROCEDURAL:SKIP")
  new, report = apply_response(bank, valid, encoder, session_index=1)
  assert report.applied and new.core.endswith("\nx") and len(new) == len(bank) + 1


def _seeded_bank():
  from cmimem_jax.encoders import HashingEncoder
  encoder = HashingEncoder(64)
  bank = MemoryBank("u", 64)
  bank, _ = apply(bank, [op(S, "ADD", "seed")], encoder)
  return bank, encoder


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=200))
def test_random_text_never_corrupts_the_bank(text):
  bank, encoder = _seeded_bank()
  before = bank.copy()
  parsed = parse("CORE:APPEND|a\n" + text)
  new, report = apply_response(bank, parsed, encoder, session_index=1)
  assert bank == before
  if not parsed.valid:
    assert new is bank and not report.applied


@settings(max_examples=200, deadline=None)
@given(responses())
def test_valid_responses_are_applied_and_broken_ones_never(case):
  """Half of the drawn responses are valid: each is applied as a new step
  (the input bank untouched), each broken one leaves the bank as it was."""
  text, ops = case
  bank, encoder = _seeded_bank()
  before = bank.copy()
  new, report = apply_response(bank, parse(text), encoder, session_index=1)
  assert bank == before
  if ops is None:
    assert new is bank and not report.applied
    return
  assert report.applied and new.step == bank.step + 1
  adds = sum(o.action is Action.ADD for o in ops)
  assert len(new) >= len(bank) + adds  # Every ADD is a new entry.
  appends = [o.new_text for o in ops if o.action is Action.APPEND]
  for text_added in appends:
    assert text_added in new.core
