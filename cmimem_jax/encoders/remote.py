"""Embeddings from an OpenAI-compatible `/v1/embeddings` endpoint (SPEC §7:
vLLM serving Qwen3-Embedding, or `python -m cmimem_jax.serve`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cmimem_jax.encoders.base import EncodeKind
from cmimem_jax.client import EndpointConfig, OpenAIClient


class OpenAIEncoder:
  """`Encoder` over an endpoint: queries get `query_prefix` (Qwen3-Embedding
  instruction), rows are re-normalised, the width is checked against
  `dim`, and a failed request raises (after the client's retries)."""

  def __init__(self, endpoint: EndpointConfig, dim: int,
               query_prefix: str = "", batch_size: int = 64):
    self.client = OpenAIClient(endpoint)
    self.dim, self.query_prefix, self.batch_size = dim, query_prefix, batch_size

  def encode(self, texts: Sequence[str],
             kind: EncodeKind = "document") -> np.ndarray:
    texts = [self.query_prefix + t if kind == "query" else t for t in texts]
    out = np.zeros((len(texts), self.dim), np.float32)
    for start in range(0, len(texts), self.batch_size):
      vectors = self.client.embed(texts[start:start + self.batch_size])
      if vectors.shape[1] != self.dim:
        raise ValueError(f"endpoint returned {vectors.shape[1]}-d embeddings;"
                         f" encoder.dim is {self.dim}")
      norms = np.linalg.norm(vectors, axis=1, keepdims=True)
      out[start:start + len(vectors)] = vectors / np.where(norms > 0, norms, 1)
    return out
