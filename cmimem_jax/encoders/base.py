"""The `Encoder` interface (SPEC §2.2) and a deterministic test encoder."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Literal, Protocol, runtime_checkable

import numpy as np

EncodeKind = Literal["query", "document"]

# The Qwen3-Embedding query instruction of every config that does not set
# `encoder.query_instruction` (the task is memory retrieval, not web search).
DEFAULT_QUERY_INSTRUCTION = ("Given a memory query, retrieve relevant "
                             "memories that answer the query")


def instructed_query(instruction: str, text: str) -> str:
  """What an instruction-tuned encoder embeds for a query: Qwen3-Embedding's
  `Instruct: {task}\nQuery:{text}`, or the raw text without an
  instruction (symmetric encoders)."""
  return f"Instruct: {instruction}\nQuery:{text}" if instruction else text


@runtime_checkable
class Encoder(Protocol):
  """Maps texts to unit-norm float32 embeddings.

  `encode(texts, kind)` returns `[n, dim]` float32 rows of unit L2 norm
  (an empty text may map to the zero vector). `kind="query"` lets
  instruction-tuned encoders (Qwen3-Embedding) add their query prefix;
  symmetric encoders ignore it.

  An encoder may say whether `encode` runs programs on the accelerator
  (`on_device`: the in-process Flax encoders) or on the host (hashing,
  an endpoint); a training step orders its scoring by it
  (`rl.IncrementalReward.needs_device`), taking an encoder that does
  not say as one on the device.
  """

  dim: int

  def encode(self, texts: Sequence[str],
             kind: EncodeKind = "document") -> np.ndarray:
    ...


_TOKEN = re.compile(r"[a-z0-9]+")


class HashingEncoder:
  """Signed feature hashing of word unigrams and bigrams, L2-normalised.

  Deterministic across processes and platforms (blake2b, not Python's
  salted `hash`), dependency-free and fast: the default for tests and for
  runs that need no neural model. Texts sharing words get positive cosine,
  which is enough to exercise retrieval and the CMI reward end to end.
  """

  on_device = False  # `Encoder`: pure host work.

  def __init__(self, dim: int = 256):
    if dim <= 0:
      raise ValueError(f"dim must be positive, got {dim}")
    self.dim = dim
    self._feature_cache: dict[str, tuple[int, float]] = {}

  def _feature(self, token: str) -> tuple[int, float]:
    cached = self._feature_cache.get(token)
    if cached is None:
      digest = hashlib.blake2b(token.encode(), digest_size=8).digest()
      value = int.from_bytes(digest, "little")
      cached = (value % self.dim, 1.0 if (value >> 63) & 1 else -1.0)
      if len(self._feature_cache) < 1_000_000:
        self._feature_cache[token] = cached
    return cached

  def encode(self, texts: Sequence[str],
             kind: EncodeKind = "document") -> np.ndarray:
    del kind  # Symmetric encoder.
    if isinstance(texts, str):
      raise TypeError("encode() takes a sequence of texts, not one string")
    out = np.zeros((len(texts), self.dim), np.float32)
    for row, text in enumerate(texts):
      words = _TOKEN.findall(text.lower())
      for token in words + [f"{a} {b}" for a, b in zip(words, words[1:])]:
        index, sign = self._feature(token)
        out[row, index] += sign
    norms = np.linalg.norm(out, axis=1, keepdims=True)
    return out / np.maximum(norms, 1e-12)
