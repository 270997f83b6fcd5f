"""OpenAI-compatible chat and embedding calls with retries and failure
accounting (SPEC §4.5).

Every call either returns text or a `CallResult` whose `error` names what
went wrong after the last attempt; `FailureLog` counts failures by kind
(timeout, http_5xx, http_4xx, connection, malformed) so a run can report
them. Nothing here turns a failure into an answer.

An `OpenAIClient` holds one pool of `concurrency` threads for its life:
every call to its endpoint, from any caller (`submit`, `chat_many`, other
threads), waits for a slot there, so `concurrency` bounds the endpoint's
load for a whole job (as verl's rate-limited reward manager bounds it
with one semaphore) and callers can keep every call of a step in flight.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from cmimem_jax.config import EndpointConfig

Messages = list[dict[str, str]]
# Whether a prompt fits the prompt budget of the model that reads it (a
# local policy's: `ChatPolicy.prompt_fits`).
PromptFits = Callable[[Messages], bool]


@dataclasses.dataclass
class CallResult:
  text: str | None
  error: str | None = None
  attempts: int = 1

  @property
  def ok(self) -> bool:
    return self.error is None


class ChatModel(Protocol):
  """Anything that answers chat conversations: `OpenAIClient` or our Flax
  policy (`sampling.ChatPolicy`)."""

  def chat_many(self, conversations: Sequence[Messages],
                max_tokens: int | None = None) -> list[CallResult]:
    """One answer per conversation, in order; `max_tokens` overrides the
    model's own answer budget."""
    ...


def then(future: concurrent.futures.Future, step: Callable[[Any], Any]
         ) -> concurrent.futures.Future:
  """A future of `step(future.result())`, run as soon as `future` is done
  (in the thread that finished it: `step` must not wait on a call); when
  `step` returns a future, of that future's result. An exception, from
  either, goes to whoever waits on the returned future."""
  out: concurrent.futures.Future = concurrent.futures.Future()

  def copy(done: concurrent.futures.Future) -> None:
    error = done.exception()
    if error is not None:
      out.set_exception(error)
    else:
      out.set_result(done.result())

  def run(done: concurrent.futures.Future) -> None:
    try:  # A callback's exception would be swallowed: hand it on.
      value = step(done.result())
    except BaseException as e:  # noqa: BLE001
      out.set_exception(e)
      return
    if isinstance(value, concurrent.futures.Future):
      value.add_done_callback(copy)
    else:
      out.set_result(value)

  future.add_done_callback(run)
  return out


def submit_chats(model: ChatModel, conversations: Sequence[Messages],
                 max_tokens: int | None = None
                 ) -> list[concurrent.futures.Future[CallResult]]:
  """One future answer per conversation: sent to an endpoint's pool at
  once (`OpenAIClient.submit`, returning immediately), or, for a model
  that only answers in batches (our policy), one `chat_many` call now,
  its answers as finished futures."""
  if isinstance(model, OpenAIClient):
    return [model.submit(m, max_tokens=max_tokens) for m in conversations]
  futures = []
  for result in model.chat_many(conversations, max_tokens):
    future: concurrent.futures.Future[CallResult] = concurrent.futures.Future()
    future.set_result(result)
    futures.append(future)
  return futures


class FailureLog:
  """Thread-safe counts of failed attempts and of calls that finally
  failed, by kind."""

  def __init__(self):
    self._lock = threading.Lock()
    self.attempt_failures: collections.Counter[str] = collections.Counter()
    self.call_failures: collections.Counter[str] = collections.Counter()

  def attempt(self, kind: str) -> None:
    with self._lock:
      self.attempt_failures[kind] += 1

  def call(self, kind: str) -> None:
    with self._lock:
      self.call_failures[kind] += 1

  def as_dict(self) -> dict[str, dict[str, int]]:
    with self._lock:
      return {"failed_attempts": dict(self.attempt_failures),
              "failed_calls": dict(self.call_failures)}


class MalformedResponse(Exception):
  """A 200 answer without the expected content."""


def classify_error(error: BaseException) -> tuple[str, bool]:
  """(kind, retryable) for an exception from the `openai` client."""
  import openai
  if isinstance(error, openai.APITimeoutError):
    return "timeout", True
  if isinstance(error, openai.APIStatusError):
    code = error.status_code
    if code >= 500:
      return "http_5xx", True
    return "http_4xx", code in (408, 409, 429)
  if isinstance(error, openai.APIConnectionError):
    return "connection", True
  return "malformed", True  # Undecodable JSON, missing fields, ...


class OpenAIClient:
  """Chat completions and embeddings against one endpoint, at most
  `config.concurrency` chat calls in flight for the client's life."""

  def __init__(self, config: EndpointConfig,
               sleep: Callable[[float], None] = time.sleep):
    import openai
    self.config = config
    self.failures = FailureLog()
    self._sleep = sleep
    self.concurrency = max(1, config.concurrency)
    # Retries are ours (counted, with jitter), not the SDK's. (The SDK's
    # connection pool holds 1,000 connections, 100 kept alive.)
    self._client = openai.OpenAI(
        base_url=config.base_url,
        api_key=os.environ.get(config.api_key_env) or "EMPTY",
        timeout=config.timeout_s, max_retries=0)
    # The endpoint's slots: one pool for every call of the client's life,
    # made on first use (a client that only embeds starts no threads).
    self._pool: concurrent.futures.ThreadPoolExecutor | None = None
    self._pool_lock = threading.Lock()

  def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
    with self._pool_lock:
      if self._pool is None:
        self._pool = concurrent.futures.ThreadPoolExecutor(
            self.concurrency, thread_name_prefix="endpoint")
      return self._pool

  def close(self) -> None:
    """Waits for the calls in flight and stops the pool (a later call
    starts a new one)."""
    with self._pool_lock:
      pool, self._pool = self._pool, None
    if pool is not None:
      pool.shutdown(wait=True)

  def _with_retries(self, call: Callable[[], Any]) -> tuple[Any, CallResult]:
    error_text, kind = "", "other"
    for attempt in range(self.config.max_retries + 1):
      try:
        return call(), CallResult(None, None, attempt + 1)
      except Exception as e:  # noqa: BLE001 - classified below.
        kind, retryable = classify_error(e)
        error_text = f"{kind}: {type(e).__name__}: {e}"[:500]
        self.failures.attempt(kind)
        if not retryable or attempt == self.config.max_retries:
          break
        delay = min(self.config.backoff_s * 2 ** attempt,
                    self.config.max_backoff_s)
        self._sleep(delay * (0.5 + random.random()))
    self.failures.call(kind)
    logging.warning("%s call failed: %s", self.config.base_url, error_text)
    return None, CallResult(None, error_text, attempt + 1)

  def chat(self, messages: Messages, **overrides: Any) -> CallResult:
    """One chat completion; `overrides` go to the request."""
    request = {"model": self.config.model, "messages": messages,
               "temperature": self.config.temperature,
               "max_tokens": self.config.max_tokens, **overrides}

    def call() -> str:
      response = self._client.chat.completions.create(**request)
      if not response.choices or response.choices[0].message.content is None:
        raise MalformedResponse("no message content in the response")
      return response.choices[0].message.content
    text, result = self._with_retries(call)
    result.text = text
    return result

  def submit(self, messages: Messages, max_tokens: int | None = None,
             **overrides: Any) -> concurrent.futures.Future[CallResult]:
    """`chat` in the endpoint's pool: returns at once; the call runs when
    one of the `concurrency` slots is free (first asked, first sent).
    Never call `.result()` of it from inside the same pool (a callback
    may `submit` more)."""
    if max_tokens is not None:
      overrides["max_tokens"] = max_tokens
    return self._executor().submit(self.chat, messages, **overrides)

  def chat_many(self, conversations: Sequence[Messages],
                max_tokens: int | None = None, **overrides: Any
                ) -> list[CallResult]:
    """`chat` calls through the endpoint's pool (at most `concurrency` in
    flight, shared with every other caller), results in input order;
    `max_tokens` overrides the endpoint's."""
    futures = [self.submit(m, max_tokens, **overrides) for m in conversations]
    return [f.result() for f in futures]

  def embed(self, texts: Sequence[str]) -> np.ndarray:
    """`[len(texts), d]` float32 embeddings; raises `RuntimeError` when the
    call fails after all retries (embeddings have no partial result)."""
    def call() -> np.ndarray:
      response = self._client.embeddings.create(model=self.config.model,
                                                input=list(texts))
      rows = sorted(response.data, key=lambda item: item.index)
      if len(rows) != len(texts):
        raise MalformedResponse(f"{len(rows)} embeddings for {len(texts)} "
                                "inputs")
      return np.asarray([row.embedding for row in rows], np.float32)
    vectors, result = self._with_retries(call)
    if vectors is None:
      raise RuntimeError(f"embedding request failed: {result.error}")
    return vectors
