"""Per-token attribution weights of a decoded completion (App. D):
tokens take the weight of the DSL line whose text they spell."""

import time
import types

import numpy as np
import pytest

from cmimem_jax.sampling import load_tokenizer
from cmimem_jax.sampling.policy import ChatPolicy
from cmimem_jax.task.episode import (attribution_weights, prefix_char_offsets,
                                     token_char_offsets)
from cmimem_jax.task.reward import _token_weights_any_order, token_weights

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


@pytest.fixture(scope="module")
def detokenizer():
  """The policy's `decode` / `decode_each` over the embedded SmolLM2
  tokenizer (no model needed)."""
  policy = ChatPolicy.__new__(ChatPolicy)
  policy.tokenizer = load_tokenizer("")
  return policy


MULTIBYTE = ("EPISODIC:ADD|2023-05-08: café with Zoë 😀, naïve 北京 "
             "ok 🇳🇴 — ∑ x²\n")


def test_offsets_by_incremental_decoding_equal_prefix_decoding(detokenizer):
  tokenizer, decode = detokenizer.tokenizer, detokenizer.decode
  rng = np.random.default_rng(0)
  multibyte = tokenizer.encode(MULTIBYTE * 4, add_special_tokens=False)
  special = list(tokenizer.all_special_ids)
  cases = {
      "random": rng.integers(0, len(tokenizer), 400).tolist(),
      "multi-byte": multibyte,
      # Special tokens (decoded as nothing) between and inside characters.
      "special": [t for i, piece in enumerate(multibyte) for t in (
          [piece, special[i % len(special)]] if i % 3 else [piece])],
      # Byte tokens that never complete a character.
      "broken": multibyte[5:9] + [multibyte[7]] * 5 + multibyte[:3],
  }
  calls = []

  def counted(ids):
    calls.append(len(ids))
    return decode(ids)
  for name, tokens in cases.items():
    oracle = prefix_char_offsets(decode, tokens)
    del calls[:]
    assert token_char_offsets(counted, tokens) == oracle, name
    # Linear: a decode of a few tokens per token, plus the whole-text
    # check (not the prefix decoding's fallback).
    assert len(calls) == len(tokens) + 2, name
    assert sum(calls) < 3 * len(tokens) + 20, name
    assert token_char_offsets(counted, tokens,
                              detokenizer.decode_each) == oracle, name
  # A decoder that does not concatenate (it strips a leading space) gets
  # the prefix decoding.
  stripped = lambda ids: decode(ids).lstrip()  # noqa: E731
  tokens = tokenizer.encode(" a b  c", add_special_tokens=False)
  assert token_char_offsets(stripped, tokens) == prefix_char_offsets(
      stripped, tokens)


def test_offsets_of_a_6000_token_response_beat_the_oracle_on_a_sixth(
    detokenizer):
  """Incremental offsets of 6,000 tokens take less than half the time the
  prefix-decoding oracle takes for their first 1,000 (measured side by
  side, so a loaded machine slows both: 25 ms against ~0.2 s on a quiet
  one; the oracle takes 14 s for all 6,000)."""
  tokenizer, decode = detokenizer.tokenizer, detokenizer.decode
  text = (MULTIBYTE + "SEMANTIC:ADD|Rex - Pet: a 3-year-old beagle\n") * 200
  tokens = tokenizer.encode(text, add_special_tokens=False)[:6000]
  assert len(tokens) == 6000
  seconds = []
  for _ in range(3):
    start = time.perf_counter()
    offsets = token_char_offsets(decode, tokens, detokenizer.decode_each)
    seconds.append(time.perf_counter() - start)
  start = time.perf_counter()
  oracle = prefix_char_offsets(decode, tokens[:1000])
  oracle_s = time.perf_counter() - start
  assert min(seconds) < 0.5 * oracle_s, (seconds, oracle_s)
  assert offsets[:1000] == oracle
  assert offsets[-1][1] == len(decode(tokens))


def test_token_weights_by_binary_search_equal_every_pair():
  rng = np.random.default_rng(1)
  for _ in range(50):
    cuts = np.sort(rng.choice(400, size=2 * rng.integers(1, 12),
                              replace=False))
    lines = [((int(a), int(b)), float(rng.integers(1, 5)))
             for a, b in cuts.reshape(-1, 2)]
    ends = np.sort(rng.integers(0, 420, 60))
    starts = np.maximum(0, ends - rng.integers(0, 9, 60))
    offsets = list(zip(starts.tolist(), ends.tolist()))
    np.testing.assert_array_equal(token_weights(offsets, lines),
                                  _token_weights_any_order(offsets, lines))
  # Lines out of text order take the pairwise path.
  lines = [((10, 20), 4.0), ((0, 12), 2.0)]
  assert token_weights([(8, 12), (9, 16)], lines).tolist() == [2.0, 4.0]
