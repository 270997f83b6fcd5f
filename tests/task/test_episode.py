"""Per-token attribution weights of a decoded completion (App. D):
tokens take the weight of the DSL line whose text they spell; policy
prompts fitted to a token budget."""

import datetime as dt
import types

import numpy as np

from cmimem_jax.data import Session, Turn
from cmimem_jax.memory import (Action, MemoryBank, MemoryType, Operation,
                               apply_operations)
from cmimem_jax.sampling import load_tokenizer
from cmimem_jax.task.episode import (attribution_weights,
                                     fitted_policy_messages, policy_messages,
                                     token_char_offsets)

TEXT = "CORE:APPEND|Owns Rex\nEPISODIC:ADD|a walk\nSEMANTIC:ADD|Rex is a beagle"


SESSION = Session("s", 2, dt.datetime(2023, 5, 8, 13, 56), "8 May 2023", (
    Turn("t1", "user", "user", "I adopted a dog named Rex."),
    Turn("t2", "assistant", "assistant", "Congratulations!")))


def line_spans(text):
  spans, start = [], 0
  for line in text.split("\n"):
    spans.append((start, start + len(line)))
    start += len(line) + 1
  return spans


def test_tokens_of_the_dominant_line_get_its_weight():
  tokenizer = load_tokenizer("")  # The embedded SmolLM2 tokenizer.
  decode = lambda ids: tokenizer.decode(ids)  # noqa: E731
  tokens = tokenizer.encode(TEXT, add_special_tokens=False)
  spans = line_spans(TEXT)
  terms = types.SimpleNamespace(line_weights=[
      (spans[0], 1.0), (spans[1], 1.0), (spans[2], 4.0)])
  weights = attribution_weights(terms, decode, tokens, len(tokens) + 3)
  offsets = token_char_offsets(decode, tokens)
  # Each token's text, and the weight of the line it lies in.
  for (start, end), weight in zip(offsets, weights):
    piece = TEXT[start:end]
    if start >= spans[2][0]:
      assert weight == 4.0, piece
    elif piece.strip():
      assert weight == 1.0, piece
  semantic = [TEXT[s:e] for (s, e), w in zip(offsets, weights) if w == 4.0]
  assert "".join(semantic).strip() == "SEMANTIC:ADD|Rex is a beagle"
  np.testing.assert_array_equal(weights[len(tokens):], [1.0, 1.0, 1.0])
  # An empty completion is all ones.
  np.testing.assert_array_equal(attribution_weights(terms, decode, [], 4),
                                np.ones(4))


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
  full, shown = fitted_policy_messages(bank, SESSION, encoder, 5)
  assert shown == 5 and full == policy_messages(bank, SESSION, encoder, 5)
  size = lambda messages: len(messages[1]["content"])  # noqa: E731
  limit = size(full) - 1
  trimmed, shown = fitted_policy_messages(
      bank, SESSION, encoder, 5, lambda m: size(m) <= limit)
  assert 0 < shown < 5 and size(trimmed) <= limit
  # The most entries that fit: one more per type would not.
  assert size(fitted_policy_messages(bank, SESSION, encoder,
                                     shown + 1)[0]) > limit
  # Each type keeps its most similar entries, in retrieval order.
  for name in ("Episodic", "Semantic"):
    assert _section(trimmed, name) == _section(full, name)[:shown]
  # Nothing fits: no retrieved entries, the core block and session stay.
  bare, shown = fitted_policy_messages(bank, SESSION, encoder, 5,
                                       lambda m: False)
  assert shown == 0 and "Name: Ana" in bare[1]["content"]
  assert not _section(bare, "Semantic") and "Rex" in bare[1]["content"]
