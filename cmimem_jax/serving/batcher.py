"""Concurrent chat requests -> batched generate calls on one worker thread.

Every request in a batch keeps its own temperature, top-p and `max_tokens`
(traced per-row values in the sampler), so one call serves them all. The
compiled program is chosen only by the batch size, padded up to a power of
two, and the prompt bucket: the token cap is always the server's
`max_new_tokens`, each row stopping at its own budget. A server therefore
compiles at most `log2(max_batch) + 1` programs per prompt bucket, all of
which `warm_up` can build before the first request.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import queue
import threading
import time
from collections.abc import Sequence

import jax
from absl import logging

from cmimem_jax.sampling import ChatPolicy


@dataclasses.dataclass(frozen=True)
class Completion:
  """One request's answer: text, token counts and the OpenAI finish
  reason ("stop": EOS or the end of generation, "length": `max_tokens`)."""
  text: str
  prompt_tokens: int
  completion_tokens: int
  finish_reason: str


@dataclasses.dataclass(frozen=True)
class _Request:
  prompt: list[int]
  temperature: float
  top_p: float
  max_tokens: int
  future: concurrent.futures.Future


def padded_batch_size(rows: int) -> int:
  """The next power of two >= `rows`: the batch sizes a server compiles."""
  return 1 << max(rows - 1, 0).bit_length()


class ChatBatcher:
  """Collects concurrent chat requests into batched generate calls.

  The first request waits up to `wait_s` for others (at most `max_batch`,
  a power of two). `max_new_tokens` is the token cap of every call.
  """

  def __init__(self, policy: ChatPolicy, max_new_tokens: int,
               max_batch: int = 8, wait_s: float = 0.01, seed: int = 0):
    if max_batch < 1 or max_batch & (max_batch - 1):
      raise ValueError(f"serve.max_batch={max_batch} must be a power of two")
    self.policy, self.max_new_tokens = policy, max_new_tokens
    self.max_batch, self.wait_s = max_batch, wait_s
    self._queue: queue.Queue[_Request | None] = queue.Queue()
    self._key = jax.random.key(seed)
    self.batches: list[int] = []  # Requests served by each generate call.
    self._closing = False
    self._thread = threading.Thread(target=self._loop, daemon=True,
                                    name="chat-batcher")
    self._thread.start()

  def submit(self, prompt: list[int], temperature: float, top_p: float,
             max_tokens: int) -> concurrent.futures.Future:
    """Queues an encoded prompt; the future resolves to a `Completion`."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    if self._closing:
      future.set_exception(RuntimeError("the server is shutting down"))
      return future
    self._queue.put(_Request(prompt, temperature, top_p, max_tokens, future))
    return future

  def warm_up(self, prompt_tokens: int = 1) -> None:
    """Compiles the program of every batch size for the prompt bucket of
    `prompt_tokens` (a later request of those shapes never compiles)."""
    size = 1
    while size <= self.max_batch:
      self._generate([[self.policy.pad_id] * prompt_tokens] * size,
                     [0.0] * size, [1.0] * size, [1] * size)
      size *= 2

  def close(self, wait: bool = True) -> None:
    """Stops the worker thread after the requests already queued
    (`wait=False`: at once; queued requests fail, a generate call in
    progress finishes on its own, daemon, thread)."""
    if not wait:
      self._closing = True
      while True:
        try:
          item = self._queue.get_nowait()
        except queue.Empty:
          break
        if item is not None:
          item.future.set_exception(RuntimeError("the server is shutting "
                                                 "down"))
    self._queue.put(None)
    if wait:
      self._thread.join()

  def _loop(self) -> None:
    while (first := self._queue.get()) is not None:
      batch = [first]
      deadline = time.monotonic() + self.wait_s
      while len(batch) < self.max_batch:
        remaining = deadline - time.monotonic()
        try:
          item = self._queue.get(timeout=max(remaining, 0))
        except queue.Empty:
          break
        if item is None:
          self._queue.put(None)  # Finish this batch, then stop.
          break
        batch.append(item)
      self._run(batch)

  def _generate(self, prompts: Sequence[list[int]],
                temperatures: Sequence[float], top_ps: Sequence[float],
                budgets: Sequence[int]):
    # Pad to a compiled batch size with one-token greedy copies of the
    # first row (they cost one step and are dropped).
    pad = padded_batch_size(len(prompts)) - len(prompts)
    self._key, key = jax.random.split(self._key)
    return self.policy.generate(
        list(prompts) + [prompts[0]] * pad, key,
        list(temperatures) + [0.0] * pad, list(top_ps) + [1.0] * pad,
        self.max_new_tokens, list(budgets) + [1] * pad)

  def _run(self, batch: list[_Request]) -> None:
    try:
      out = self._generate([r.prompt for r in batch],
                           [r.temperature for r in batch],
                           [r.top_p for r in batch],
                           [r.max_tokens for r in batch])
      self.batches.append(len(batch))
      for row, request in enumerate(batch):
        generated = out.tokens[row, :out.lengths[row]].tolist()
        stopped = bool(generated) and generated[-1] in self.policy.eos_ids
        finish = "stop" if stopped or len(generated) < request.max_tokens \
            else "length"
        request.future.set_result(Completion(
            self.policy.decode(self.policy.completion_tokens(out, row)),
            len(request.prompt), len(generated), finish))
    except Exception as e:  # noqa: BLE001 - reported to every caller.
      logging.exception("generation failed")
      for request in batch:
        if not request.future.done():
          request.future.set_exception(e)
