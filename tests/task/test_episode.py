"""Per-token attribution weights of a decoded completion (App. D):
tokens take the weight of the DSL line whose text they spell."""

import types

import numpy as np

from cmimem_jax.sampling import load_tokenizer
from cmimem_jax.task.episode import attribution_weights, token_char_offsets

TEXT = "CORE:APPEND|Owns Rex\nEPISODIC:ADD|a walk\nSEMANTIC:ADD|Rex is a beagle"


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
