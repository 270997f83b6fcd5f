"""Embeddings from an OpenAI-compatible `/v1/embeddings` endpoint (SPEC §7:
vLLM serving Qwen3-Embedding, or `python -m cmimem_jax.serve`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cmimem_jax.encoders.base import EncodeKind, instructed_query
from cmimem_jax.client import EndpointConfig, OpenAIClient


class OpenAIEncoder:
  """`Encoder` over an endpoint: queries are embedded as
  `instructed_query(query_instruction, text)` (Qwen3-Embedding served by
  vLLM; "": raw text), rows are re-normalised, the width is checked against
  `dim`, and a failed request raises (after the client's retries)."""

  on_device = False  # `Encoder`: the host only waits on the endpoint.

  def __init__(self, endpoint: EndpointConfig, dim: int,
               query_instruction: str = "", batch_size: int = 64):
    self.client = OpenAIClient(endpoint)
    self.dim, self.batch_size = dim, batch_size
    self.query_instruction = query_instruction

  def query_text(self, text: str) -> str:
    """What this encoder embeds for the query `text`."""
    return instructed_query(self.query_instruction, text)

  def encode(self, texts: Sequence[str],
             kind: EncodeKind = "document") -> np.ndarray:
    texts = [self.query_text(t) if kind == "query" else t for t in texts]
    out = np.zeros((len(texts), self.dim), np.float32)
    for start in range(0, len(texts), self.batch_size):
      vectors = self.client.embed(texts[start:start + self.batch_size])
      if vectors.shape[1] != self.dim:
        raise ValueError(f"endpoint returned {vectors.shape[1]}-d embeddings;"
                         f" encoder.dim is {self.dim}")
      norms = np.linalg.norm(vectors, axis=1, keepdims=True)
      out[start:start + len(vectors)] = vectors / np.where(norms > 0, norms, 1)
    return out
