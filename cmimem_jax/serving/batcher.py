"""Concurrent chat requests -> batched generate calls on one worker thread.

Every request in a batch keeps its own temperature, top-p and `max_tokens`
(traced per-row values in the sampler), so one call serves them all. The
compiled program is chosen only by the batch size, padded up to a power of
two, and the prompt bucket: the token cap is always the server's
`max_new_tokens`, each row stopping at its own budget. A server therefore
compiles at most `log2(max_batch) + 1` programs per prompt bucket, all of
which `warm_up` builds before the first request (compiling, or loading from
JAX's persistent compilation cache, without generating).

Stop strings (OpenAI's `stop`, up to `MAX_STOPS` per request) end a reply
where one first occurs, excluded from it, finish reason "stop". The text
decides: a stop string is found in the decoded reply whatever tokens the
model wrote it with. Decoding also ends early, in the sampler, when the
model writes a stop string with the tokens it has on its own (up to
`STOP_TOKENS` of them; each row its own, traced, so the compiled programs
stay those of the warm-up).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Sequence

import jax
from absl import logging

from cmimem_jax.sampling import ChatPolicy
from cmimem_jax.sampling.sampler import bucket_length

# OpenAI's limit of stop strings per request, and the longest one (in
# tokens) the sampler stops at by itself (longer ones: the text is cut).
MAX_STOPS, STOP_TOKENS = 4, 16


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
  """`text` up to the first occurrence of any of `stops` (excluded), and
  whether one occurred."""
  found = [i for i in (text.find(s) for s in stops if s) if i >= 0]
  return (text[:min(found)], True) if found else (text, False)


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
  stop: tuple[str, ...] = ()
  stop_tokens: tuple[tuple[int, ...], ...] = ()


class ShuttingDown(RuntimeError):
  """A request the server could not finish before stopping (answered 503)."""

  def __init__(self):
    super().__init__("the server is shutting down; retry later")


# progress(k, n, batch size, prompt bucket, seconds): program k of n built.
Progress = Callable[[int, int, int, int, float], None]


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
    # (batch size, prompt bucket) of the programs built before serving, and
    # those a request had to wait for because the warm-up did not build them.
    self.warmed: set[tuple[int, int]] = set()
    self.cold_programs: list[tuple[int, int]] = []
    self._closing = False
    # The batch being collected or generated.
    self._running: list[_Request] = []
    self._thread = threading.Thread(target=self._loop, daemon=True,
                                    name="chat-batcher")
    self._thread.start()

  def submit(self, prompt: list[int], temperature: float, top_p: float,
             max_tokens: int, stop: Sequence[str] = (),
             stop_tokens: Sequence[Sequence[int]] = ()
             ) -> concurrent.futures.Future:
    """Queues an encoded prompt with its stop strings (and their tokens,
    `ChatPolicy.stop_tokens`); the future resolves to a `Completion`."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    if self._closing:
      future.set_exception(ShuttingDown())
      return future
    self._queue.put(_Request(prompt, temperature, top_p, max_tokens, future,
                             tuple(stop), tuple(map(tuple, stop_tokens))))
    return future

  def warm_up_programs(self, prompt_tokens: Sequence[int] = (1,)
                       ) -> list[tuple[int, int]]:
    """(batch size, prompt bucket) of every program serving prompts of
    these lengths: each padded batch size for each of their buckets."""
    buckets = sorted({bucket_length(t, self.policy.engine.buckets)
                      for t in prompt_tokens})
    sizes = [1 << i for i in range(self.max_batch.bit_length())]
    return [(size, bucket) for bucket in buckets for size in sizes]

  def warm_up(self, programs: Sequence[tuple[int, int]],
              progress: Progress | None = None) -> None:
    """Compiles, or loads from JAX's persistent compilation cache, the
    `programs` (`warm_up_programs`) without generating (no KV cache
    allocated): a later request of those shapes never compiles.
    `progress` is called after each program."""
    # A request's first program is the key split: built here by drawing
    # one key.
    self._next_key()
    for k, (size, bucket) in enumerate(programs, 1):
      start = time.perf_counter()
      self.policy.engine.compile(size, bucket, self.max_new_tokens)
      self.warmed.add((size, bucket))
      if progress is not None:
        progress(k, len(programs), size, bucket, time.perf_counter() - start)

  def close(self, wait: bool = True) -> None:
    """Stops the worker thread after the requests already queued
    (`wait=False`: at once; queued requests and those of the generate call
    in progress fail with `ShuttingDown`, the call itself finishing on its
    own, daemon, thread)."""
    if not wait:
      self._closing = True
      for request in list(self._running):
        _settle(request.future, error=ShuttingDown())
      while True:
        try:
          item = self._queue.get_nowait()
        except queue.Empty:
          break
        if item is not None:
          _settle(item.future, error=ShuttingDown())
    self._queue.put(None)
    if wait:
      self._thread.join()

  def _loop(self) -> None:
    while (first := self._queue.get()) is not None:
      # Visible to `close` from the first request collected.
      self._running = batch = [first]
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

  def _next_key(self) -> jax.Array:
    self._key, key = jax.random.split(self._key)
    return key

  def _generate(self, batch: Sequence[_Request]):
    # Pad to a compiled batch size with one-token greedy copies of the
    # first row (they cost one step and are dropped).
    pad = padded_batch_size(len(batch)) - len(batch)
    prompts = [r.prompt for r in batch]
    self._note_cold_program(len(batch) + pad,
                            bucket_length(max(map(len, prompts)),
                                          self.policy.engine.buckets))
    # An engine without per-row stop tables decodes to each budget; the
    # text is cut all the same.
    row_stops = ([r.stop_tokens for r in batch] + [()] * pad
                 if getattr(self.policy.engine, "row_stop_shape", None)
                 else None)
    return self.policy.generate(
        prompts + [prompts[0]] * pad, self._next_key(),
        [r.temperature for r in batch] + [0.0] * pad,
        [r.top_p for r in batch] + [1.0] * pad, self.max_new_tokens,
        [r.max_tokens for r in batch] + [1] * pad,
        row_stops=row_stops)

  def _note_cold_program(self, size: int, bucket: int) -> None:
    """Says so when a request runs a program the warm-up did not build: it
    waits for a compile (or a cache load), once per program."""
    if (size, bucket) in self.warmed:
      return
    self.warmed.add((size, bucket))
    self.cold_programs.append((size, bucket))
    logging.warning(
        "batch %d, prompt bucket %d was not warmed up: this request waits "
        "for its program (add its length to serve.warm_up_prompt_tokens)",
        size, bucket)

  def _run(self, batch: list[_Request]) -> None:
    if self._closing:  # Closed while this batch was collected.
      for request in batch:
        _settle(request.future, error=ShuttingDown())
      return
    try:
      out = self._generate(batch)
      self.batches.append(len(batch))
      for row, request in enumerate(batch):
        generated = out.tokens[row, :out.lengths[row]].tolist()
        text, cut = cut_at_stop(self.policy.decode(
            self.policy.completion_tokens(out, row)), request.stop)
        stopped = cut or (bool(generated)
                          and generated[-1] in self.policy.eos_ids)
        finish = "stop" if stopped or len(generated) < request.max_tokens \
            else "length"
        _settle(request.future, Completion(
            text, len(request.prompt), len(generated), finish))
    except Exception as e:  # noqa: BLE001 - reported to every caller.
      logging.exception("generation failed")
      for request in batch:
        _settle(request.future, error=e)
    finally:
      self._running = []


def _settle(future: concurrent.futures.Future,
            result: Completion | None = None,
            error: BaseException | None = None) -> None:
  """Resolves `future` unless it already is (a shutdown failed it while
  its generate call ran)."""
  try:
    if error is not None:
      future.set_exception(error)
    else:
      future.set_result(result)
  except concurrent.futures.InvalidStateError:
    pass
