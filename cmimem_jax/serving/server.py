"""An OpenAI-compatible server for our Flax policy and encoder (SPEC §7),
run by `python -m cmimem_jax.serve`.

`POST /v1/chat/completions` (messages -> the policy's chat template ->
sampler), `POST /v1/embeddings` (the encoder), `GET /v1/models`. Bound to
127.0.0.1 unless `--host` says otherwise; with `serve.api_key_env` naming a
set environment variable, requests need `Authorization: Bearer <key>`.
Concurrent chat requests are batched: the first request waits up to
`serve.batch_wait_ms` for others (at most `serve.max_batch`), and requests
with the same sampling parameters share one generate call. Bad requests
get a 4xx with a message; generation errors a 500 with a message.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import os
import queue
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import jax
from absl import logging

from cmimem_jax.encoders import Encoder, make_encoder
from cmimem_jax.sampling import ChatPolicy, load_policy, load_tokenizer


class RequestError(ValueError):
  """A client error: answered with 400 and this message."""


class ChatBatcher:
  """Collects concurrent chat requests into batched generate calls."""

  def __init__(self, policy: ChatPolicy, max_batch: int = 8,
               wait_s: float = 0.01, seed: int = 0):
    self.policy, self.max_batch, self.wait_s = policy, max_batch, wait_s
    self._queue: queue.Queue = queue.Queue()
    self._key = jax.random.key(seed)
    self.batches: list[int] = []  # Sizes of the generate calls made.
    self._thread = threading.Thread(target=self._loop, daemon=True)
    self._thread.start()

  def submit(self, messages: list[dict[str, str]], temperature: float,
             top_p: float, max_tokens: int) -> concurrent.futures.Future:
    # Encoding here surfaces prompt errors to the caller as a 400.
    prompt = self.policy.encode(messages)
    future: concurrent.futures.Future = concurrent.futures.Future()
    self._queue.put(((temperature, top_p, max_tokens), prompt, future))
    return future

  def _loop(self) -> None:
    while True:
      items = [self._queue.get()]
      deadline = time.monotonic() + self.wait_s
      while len(items) < self.max_batch:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
          break
        try:
          items.append(self._queue.get(timeout=remaining))
        except queue.Empty:
          break
      groups: dict[tuple, list] = collections.defaultdict(list)
      for params, prompt, future in items:
        groups[params].append((prompt, future))
      for (temperature, top_p, max_tokens), group in groups.items():
        self._run(group, temperature, top_p, max_tokens)

  def _run(self, group, temperature, top_p, max_tokens) -> None:
    try:
      self._key, key = jax.random.split(self._key)
      out = self.policy.generate([p for p, _ in group], key, temperature,
                                 top_p, max_tokens)
      self.batches.append(len(group))
      for row, (prompt, future) in enumerate(group):
        generated = out.tokens[row, :out.lengths[row]].tolist()
        stopped = bool(generated) and generated[-1] in self.policy.eos_ids
        finish = ("stop" if stopped or len(generated) < max_tokens
                  else "length")
        future.set_result((
            self.policy.decode(self.policy.completion_tokens(out, row)),
            len(prompt), len(generated), finish))
    except Exception as e:  # noqa: BLE001 - reported to every caller.
      logging.exception("generation failed")
      for _, future in group:
        if not future.done():
          future.set_exception(e)


def _number(body: dict, name: str, default: float, low: float, high: float
            ) -> float:
  value = body.get(name, default)
  if value is None:
    return default
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
      low <= value <= high):
    raise RequestError(f"'{name}' must be a number in [{low}, {high}]")
  return float(value)


def parse_chat_request(body: Any, max_tokens_limit: int
                       ) -> tuple[list[dict[str, str]], float, float, int]:
  """Validates an OpenAI chat request body."""
  if not isinstance(body, dict):
    raise RequestError("request body must be a JSON object")
  messages = body.get("messages")
  if not isinstance(messages, list) or not messages:
    raise RequestError("'messages' must be a non-empty list")
  for i, message in enumerate(messages):
    if (not isinstance(message, dict) or message.get("role") not in (
        "system", "user", "assistant") or not isinstance(
            message.get("content"), str)):
      raise RequestError(f"messages[{i}] needs a role (system/user/"
                         "assistant) and string content")
  temperature = _number(body, "temperature", 0.0, 0.0, 2.0)
  top_p = _number(body, "top_p", 1.0, 1e-6, 1.0)
  max_tokens = int(_number(body, "max_tokens", min(256, max_tokens_limit),
                           1, max_tokens_limit))
  if body.get("stream"):
    raise RequestError("streaming is not supported")
  return ([{"role": m["role"], "content": m["content"]} for m in messages],
          temperature, top_p, max_tokens)


def make_handler(batcher: ChatBatcher | None, encoder: Encoder | None,
                 model_name: str, api_key: str | None,
                 max_tokens_limit: int):
  encode_lock = threading.Lock()

  class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):
      logging.debug("%s " + fmt, self.address_string(), *args)

    def _send(self, code: int, payload: dict) -> None:
      body = json.dumps(payload).encode()
      self.send_response(code)
      self.send_header("Content-Type", "application/json")
      self.send_header("Content-Length", str(len(body)))
      self.end_headers()
      self.wfile.write(body)

    def _error(self, code: int, message: str) -> None:
      self._send(code, {"error": {"message": message, "code": code}})

    def _authorized(self) -> bool:
      if api_key and self.headers.get("Authorization") != f"Bearer {api_key}":
        self._error(401, "missing or wrong API key")
        return False
      return True

    def do_GET(self):
      if not self._authorized():
        return
      if self.path.rstrip("/") == "/v1/models":
        self._send(200, {"object": "list", "data": [
            {"id": model_name, "object": "model", "owned_by": "cmimem_jax"}]})
      else:
        self._error(404, f"no route {self.path}")

    def do_POST(self):
      if not self._authorized():
        return
      try:
        length = int(self.headers.get("Content-Length") or 0)
        try:
          body = json.loads(self.rfile.read(length) or b"null")
        except json.JSONDecodeError as e:
          raise RequestError(f"invalid JSON: {e}") from e
        path = self.path.rstrip("/")
        if path == "/v1/chat/completions" and batcher is not None:
          self._chat(body)
        elif path == "/v1/embeddings" and encoder is not None:
          self._embeddings(body)
        else:
          self._error(404, f"no route {self.path}")
      except RequestError as e:
        self._error(400, str(e))
      except ValueError as e:  # E.g. a prompt over the length limit.
        self._error(400, str(e))
      except Exception as e:  # noqa: BLE001 - reported, not hidden.
        logging.exception("request failed")
        self._error(500, f"{type(e).__name__}: {e}")

    def _chat(self, body: Any) -> None:
      messages, temperature, top_p, max_tokens = parse_chat_request(
          body, max_tokens_limit)
      text, prompt_tokens, completion_tokens, finish = batcher.submit(
          messages, temperature, top_p, max_tokens).result()
      self._send(200, {
          "id": f"chatcmpl-{time.monotonic_ns()}", "object": "chat.completion",
          "created": int(time.time()), "model": model_name,
          "choices": [{"index": 0, "finish_reason": finish,
                       "message": {"role": "assistant", "content": text}}],
          "usage": {"prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens}})

    def _embeddings(self, body: Any) -> None:
      if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
      texts = body.get("input")
      texts = [texts] if isinstance(texts, str) else texts
      if (not isinstance(texts, list) or not texts
          or not all(isinstance(t, str) for t in texts)):
        raise RequestError("'input' must be a string or a non-empty list of "
                           "strings")
      kind = "query" if body.get("input_type") == "query" else "document"
      with encode_lock:
        vectors = encoder.encode(texts, kind=kind)
      self._send(200, {"object": "list", "model": model_name, "data": [
          {"object": "embedding", "index": i, "embedding": v.tolist()}
          for i, v in enumerate(vectors)],
          "usage": {"prompt_tokens": 0, "total_tokens": 0}})

  return Handler


class _HTTPServer(ThreadingHTTPServer):
  daemon_threads = True
  request_queue_size = 256  # Bursts of concurrent clients (default: 5).


class BackgroundServer:
  """An OpenAI-style HTTP server run in a daemon thread while inside
  `with ...:`; `base_url` ends in `/v1`."""

  def __init__(self, handler: type[BaseHTTPRequestHandler],
               host: str = "127.0.0.1", port: int = 0):
    self.httpd = _HTTPServer((host, port), handler)
    self._thread = threading.Thread(target=self.httpd.serve_forever,
                                    daemon=True)

  @property
  def base_url(self) -> str:
    host, port = self.httpd.server_address[:2]
    return f"http://{host}:{port}/v1"

  def __enter__(self):
    self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self.httpd.shutdown()
    self.httpd.server_close()


class Server(BackgroundServer):
  """Our policy and encoder behind the OpenAI API (`with Server(...) as
  s:`)."""

  def __init__(self, config: Any, host: str = "127.0.0.1", port: int = 0):
    serve = config.serve
    batcher = None
    if serve.chat:
      tokenizer = load_tokenizer(config.policy.tokenizer)
      policy = ChatPolicy.jax(load_policy(config.policy, len(tokenizer)),
                              tokenizer, serve.max_prompt_tokens,
                              tuple(serve.buckets))
      batcher = ChatBatcher(policy, serve.max_batch,
                            serve.batch_wait_ms / 1000.0, config.seed)
    self.batcher = batcher
    self.encoder = make_encoder(config.encoder) if serve.embeddings else None
    api_key = os.environ.get(serve.api_key_env) if serve.api_key_env else None
    handler = make_handler(batcher, self.encoder, serve.model_name, api_key,
                           serve.max_new_tokens)
    super().__init__(handler, host, port)
