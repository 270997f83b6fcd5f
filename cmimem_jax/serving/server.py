"""An OpenAI-compatible server for our Flax policy and encoder (SPEC §7),
run by `python -m cmimem_jax.serve`: the app of `serving.app` on uvicorn.

Bound to 127.0.0.1 unless `--host` says otherwise. With
`serve.api_key_env` set, the named environment variable must hold a
non-empty key or the server refuses to start. uvicorn bounds open
connections (`serve.max_connections`, then 503) and closes any connection
with no request in progress after `serve.idle_timeout_s`, including one
that never finishes its headers (uvicorn alone only times out idle
keep-alive connections after a response).

Start-up: `/health` answers 503 while the warm-up builds every program a
request can run (`ChatBatcher.warm_up`: compiled, or loaded from JAX's
persistent compilation cache), reporting each to `progress`; then 200, and
`on_ready` is called. Shutdown (SIGTERM / Ctrl-C) drains: no new
connections, requests in flight get `serve.shutdown_timeout_s` to finish,
then the chat requests still waiting are answered 503 (never cancelled
mid-response).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import ClassVar

import ml_collections
import uvicorn
from absl import logging
from uvicorn.protocols.http.h11_impl import H11Protocol

from cmimem_jax.config import (Section, Sections, finite_number, need,
                               positive_int, validate_config)
from cmimem_jax.encoders import EncoderConfig, make_encoder
from cmimem_jax.sampling import (ChatPolicy, PolicyConfig,
                                 load_policy_and_tokenizer)
from cmimem_jax.serving.app import Limits, make_app
from cmimem_jax.serving.batcher import (MAX_STOPS, STOP_TOKENS, ChatBatcher,
                                        Progress)

# Seconds a request failed at the end of the drain has to send its 503.
_ANSWER_S = 2.0


@dataclasses.dataclass(frozen=True)
class ServeConfig(Section):
  """The `serve` section (`configs/serve_cpu.py` says what each means)."""

  SECTION: ClassVar[str] = "serve"

  chat: bool                  # /v1/chat/completions with the policy.
  embeddings: bool            # /v1/embeddings with the encoder.
  model_name: str             # The one model name requests may ask for.
  max_batch: int              # Chat rows decoded together.
  batch_wait_ms: float        # How long a batch waits for more rows.
  max_new_tokens: int
  max_prompt_tokens: int
  buckets: tuple[int, ...]    # Prompt lengths compiled (padded up to).
  api_key_env: str            # "" : no key; else the variable holding it.
  max_request_bytes: int      # Larger bodies: 413.
  body_timeout_s: float       # Slower bodies: 408.
  max_pending: int            # More chat requests in flight: 429.
  max_connections: int        # More connections: 503.
  idle_timeout_s: float       # A connection with no request is closed.
  max_embedding_inputs: int   # More inputs: 413.
  max_embedding_chars: int    # Longer inputs: 400.
  shutdown_timeout_s: float   # The drain after SIGTERM / Ctrl-C.
  # The prompt lengths whose buckets are compiled before serving.
  warm_up_prompt_tokens: tuple[int, ...]

  def invalid(self) -> Iterator[str]:
    for key in ("max_batch", "max_new_tokens", "max_prompt_tokens",
                "max_request_bytes", "max_pending", "max_connections",
                "max_embedding_inputs", "max_embedding_chars"):
      yield from need(self, key, positive_int, "a positive integer")
    for key in ("body_timeout_s", "idle_timeout_s"):
      yield from need(self, key, lambda v: v > 0, "> 0 seconds")
    for key in ("batch_wait_ms", "shutdown_timeout_s"):
      yield from need(self, key, lambda v: finite_number(v, 0.0), ">= 0")
    yield from need(self, "model_name", bool, "a non-empty name")
    yield from need(self, "buckets",
                    lambda v: v and all(positive_int(b) for b in v),
                    "a non-empty list of positive integers")
    yield from need(self, "warm_up_prompt_tokens",
                    lambda v: all(positive_int(t) for t in v),
                    "a list of positive integers")


@dataclasses.dataclass(frozen=True)
class ServeRunConfig(Section):
  """The server's top-level fields."""

  seed: int  # The chat sampler's key.


# What `Server` reads (`serve` validates them before anything loads).
SERVE_SECTIONS = (ServeConfig, ServeRunConfig, PolicyConfig, EncoderConfig)


class _IdleClosingH11(H11Protocol):
  """uvicorn's HTTP/1.1 protocol, also closing connections that sit
  `timeout_keep_alive` seconds without a request being handled (a slow or
  silent client never holds a connection open)."""

  def connection_made(self, transport) -> None:  # noqa: ANN001
    super().connection_made(transport)
    self._idle_timer = None
    self._arm_idle_timer()

  def on_response_complete(self) -> None:
    super().on_response_complete()
    self._arm_idle_timer()

  def connection_lost(self, exc: Exception | None) -> None:
    if self._idle_timer is not None:
      self._idle_timer.cancel()
    super().connection_lost(exc)

  def _arm_idle_timer(self) -> None:
    if self._idle_timer is not None:
      self._idle_timer.cancel()
    self._idle_timer = self.loop.call_later(self.timeout_keep_alive,
                                            self._close_if_idle)

  def _close_if_idle(self) -> None:
    self._idle_timer = None
    handling = self.cycle is not None and not self.cycle.response_complete
    if not handling and not self.transport.is_closing():
      self.transport.close()


class _DrainingUvicorn(uvicorn.Server):
  """uvicorn whose graceful shutdown ends in answers: after `drain_s`,
  `on_timeout` fails the requests still in flight (the app answers them
  503) and they get `_ANSWER_S` to send that, where uvicorn alone would
  cancel them (one `CancelledError` traceback each)."""

  def __init__(self, config: uvicorn.Config, drain_s: float,
               on_timeout: Callable[[], None]):
    super().__init__(config)
    self.drain_s, self.on_timeout = drain_s, on_timeout

  async def shutdown(self, sockets: list[socket.socket] | None = None
                     ) -> None:
    timer = asyncio.get_running_loop().call_later(self.drain_s,
                                                  self.on_timeout)
    try:
      await super().shutdown(sockets)
    finally:
      timer.cancel()


def api_key_from_env(variable: str) -> str | None:
  """The key named by `serve.api_key_env` ("" : no key). Fails closed: a
  named variable that is unset or empty is an error, not an open server."""
  if not variable:
    return None
  key = os.environ.get(variable, "")
  if not key:
    raise ValueError(f"serve.api_key_env={variable!r} names an unset or "
                     "empty environment variable: refusing to start without "
                     "the key (set it, or set serve.api_key_env='' for no "
                     "key)")
  return key


class Server:
  """Our policy and encoder behind the OpenAI API.

  `with Server(config) as s:` serves from a background thread (`s.base_url`
  ends in `/v1`); `Server(config).serve_forever()` in the foreground.
  `config`: the server's config, or its `SERVE_SECTIONS` validated already
  (`validate_config`: what `python -m cmimem_jax.serve` passes).
  `progress`: called after each warm-up program; `on_ready(base_url)`:
  once `/health` answers 200.
  """

  def __init__(self, config: ml_collections.ConfigDict | Sections,
               host: str = "127.0.0.1", port: int = 0,
               progress: Progress | None = None,
               on_ready: Callable[[str], None] | None = None):
    sections = (config if isinstance(config, Sections) else
                validate_config(config, required=SERVE_SECTIONS))
    serve = sections[ServeConfig]
    api_key = api_key_from_env(serve.api_key_env)
    self.batcher = None
    self.programs: list[tuple[int, int]] = []  # (batch, prompt bucket)
    self._progress, self._on_ready = progress, on_ready
    self.warm_up_error: Exception | None = None
    # Set once every warm-up program is compiled: until then /health and
    # chat requests answer 503 (a client never waits on a compile).
    self.ready = threading.Event()
    if serve.chat:
      model, tokenizer = load_policy_and_tokenizer(sections[PolicyConfig])
      # Requests are unrelated rows: no prompt sharing, so the compiled
      # programs depend on the batch size alone (warm-up included).
      policy = ChatPolicy.jax(model, tokenizer, serve.max_prompt_tokens,
                              tuple(serve.buckets), share_prompts=False,
                              prompt_limit_name="serve.max_prompt_tokens",
                              row_stop_shape=(MAX_STOPS, STOP_TOKENS))
      self.batcher = ChatBatcher(policy, serve.max_new_tokens,
                                 serve.max_batch,
                                 serve.batch_wait_ms / 1000.0,
                                 sections[ServeRunConfig].seed)
      self.programs = self.batcher.warm_up_programs(
          serve.warm_up_prompt_tokens)
    self.encoder = (make_encoder(sections[EncoderConfig]) if serve.embeddings
                    else None)
    self.app = make_app(self.batcher, self.encoder, serve.model_name,
                        api_key, Limits(
                            serve.max_new_tokens, serve.max_request_bytes,
                            serve.body_timeout_s, serve.max_pending,
                            serve.max_embedding_inputs,
                            serve.max_embedding_chars),
                        self.ready)
    # Bound here, so port 0 has its real number before serving starts.
    self.socket = socket.create_server((host, port), backlog=1024)
    self._uvicorn = _DrainingUvicorn(uvicorn.Config(
        self.app, http=_IdleClosingH11, lifespan="off", log_level="warning",
        timeout_keep_alive=serve.idle_timeout_s,
        limit_concurrency=serve.max_connections, backlog=1024,
        timeout_graceful_shutdown=serve.shutdown_timeout_s + _ANSWER_S),
        # On SIGTERM / Ctrl-C: requests in flight get this long, then those
        # still waiting are answered 503 (a generate call cannot be
        # interrupted: it finishes on its own thread, unread).
        serve.shutdown_timeout_s, self._fail_pending)
    self._thread: threading.Thread | None = None
    self._warm_up_thread = threading.Thread(target=self._warm_up, daemon=True,
                                            name="warm-up")

  def _warm_up(self) -> None:
    if self.programs:
      try:
        self.batcher.warm_up(self.programs, self._progress)
      except Exception as e:  # noqa: BLE001 - stops the server, reported.
        logging.error("warm-up failed: %s: %s", type(e).__name__, e)
        self.warm_up_error = e
        self._uvicorn.should_exit = True
        return
    self.ready.set()
    while not self._uvicorn.started:  # /health answers once uvicorn listens.
      if self._uvicorn.should_exit:
        return
      time.sleep(0.01)
    if self._on_ready is not None:
      self._on_ready(self.base_url)

  def _fail_pending(self) -> None:
    if self.batcher is not None:
      self.batcher.close(wait=False)

  @property
  def base_url(self) -> str:
    host, port = self.socket.getsockname()[:2]
    return f"http://{host}:{port}/v1"

  def serve_forever(self) -> None:
    """Serves in this thread until interrupted (Ctrl-C / SIGTERM; uvicorn
    then re-raises the signal): requests in flight get
    `serve.shutdown_timeout_s` to finish, the rest are answered 503, and
    it returns without waiting for a generate call still running. Raises
    RuntimeError if the warm-up failed."""
    self._warm_up_thread.start()
    try:
      self._uvicorn.run(sockets=[self.socket])
    finally:
      self.close(wait=False)
    if self.warm_up_error is not None:
      raise RuntimeError(f"warm-up failed: {type(self.warm_up_error).__name__}"
                         f": {self.warm_up_error}")

  def close(self, wait: bool = True) -> None:
    """Stops the batcher and the host-side worker threads (`wait=False`:
    without waiting for work in progress; queued requests fail)."""
    if self.batcher is not None:
      self.batcher.close(wait)
    for pool in self.app.state.pools:
      pool.shutdown(wait=wait, cancel_futures=True)

  def __enter__(self) -> Server:
    self._warm_up_thread.start()
    self._thread = threading.Thread(
        target=self._uvicorn.run, kwargs={"sockets": [self.socket]},
        daemon=True, name="uvicorn")
    self._thread.start()
    deadline = time.monotonic() + 30
    while not self._uvicorn.started:
      if not self._thread.is_alive() or time.monotonic() > deadline:
        raise RuntimeError("the HTTP server did not start")
      time.sleep(0.01)
    return self

  def __exit__(self, *exc: object) -> None:
    self._uvicorn.should_exit = True
    self._thread.join()
    self.socket.close()
    self.close()
