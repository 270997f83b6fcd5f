"""Our Flax policy as a chat model (the same `chat_many` interface as the
OpenAI client), for answering and memory building without an endpoint."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from cmimem_jax.evaluation.client import CallResult, Messages
from cmimem_jax.sampling.sampler import Sampler


class LocalChatModel:
  """Applies the tokenizer's chat template, generates with `Sampler`.

  Args:
    sampler: a sampler over the policy (its config: temperature, length).
    tokenizer: a `transformers` tokenizer with a chat template.
    batch_size: conversations per generate call.
    seed: sampling key (irrelevant for greedy decoding).
  """

  def __init__(self, sampler: Sampler, tokenizer: Any, batch_size: int = 8,
               seed: int = 0):
    self.sampler, self.tokenizer = sampler, tokenizer
    self.batch_size = batch_size
    self._key = jax.random.key(seed)

  def encode(self, messages: Messages) -> list[int]:
    ids = self.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding.
      ids = ids["input_ids"]
    return list(ids)

  def chat_many(self, conversations: Sequence[Messages]) -> list[CallResult]:
    results = []
    for start in range(0, len(conversations), self.batch_size):
      batch = [self.encode(m) for m in
               conversations[start:start + self.batch_size]]
      self._key, key = jax.random.split(self._key)
      out = self.sampler(batch, key)
      for tokens in out.completions():
        results.append(CallResult(self.tokenizer.decode(
            tokens, skip_special_tokens=True)))
    return results
