"""The OpenAI-compatible ASGI application (Starlette).

Routes: `POST /v1/chat/completions` (with `stream: true` as server-sent
events), `POST /v1/embeddings`, `GET /v1/models`, and `GET /health` (the
only route without the API key). Every limit answers with a 4xx and a JSON
error, never by hanging or allocating without bound: bodies over
`max_request_bytes` get 413 (from the Content-Length header, before
reading), a body not received within `body_timeout_s` 408, more than
`max_pending` chat requests in flight 429 with `Retry-After`, more than
`max_embedding_inputs` embedding inputs 413 (longer inputs than
`max_embedding_chars` 400), JSON nested too deeply 400, a missing or wrong
key 401 (compared in constant time), another model's name 404
`model_not_found`, a `stop` other than a string or a list of up to 4
strings 400, any request before the programs are compiled 503, a chat
request the server stops before answering 503. A client that disconnects
before its body arrives is one INFO line (nobody to answer).
Responses to requests whose body may be left unread close the connection.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import hmac
import json
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from absl import logging
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from cmimem_jax.encoders import Encoder
from cmimem_jax.serving.batcher import (MAX_STOPS, ChatBatcher, Completion,
                                        ShuttingDown)


class ClientGone(Exception):
  """The client disconnected before its request body arrived: there is no
  one to answer (logged at INFO, one line)."""


class RequestError(ValueError):
  """A client error: answered with `status` (400 unless said) and this
  message."""

  def __init__(self, message: str, status: int = 400,
               headers: dict[str, str] | None = None):
    super().__init__(message)
    self.status, self.headers = status, headers or {}


@dataclasses.dataclass(frozen=True)
class Limits:
  """What one request may cost (the `serve` config section's fields)."""
  max_new_tokens: int = 512
  max_request_bytes: int = 1 << 20
  body_timeout_s: float = 10.0
  max_pending: int = 256
  # /v1/embeddings: inputs per request (413 past it), characters per
  # input (400), and inputs encoded per turn of the encode thread (other
  # requests get their turn in between).
  max_embedding_inputs: int = 256
  max_embedding_chars: int = 32_768
  embedding_chunk: int = 32


@dataclasses.dataclass(frozen=True)
class ChatRequest:
  messages: list[dict[str, str]]
  temperature: float
  top_p: float
  max_tokens: int
  stream: bool
  stop: tuple[str, ...] = ()


def _number(body: dict, name: str, default: float, low: float, high: float
            ) -> float:
  value = body.get(name, default)
  if value is None:
    return default
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
      low <= value <= high):
    raise RequestError(f"'{name}' must be a number in [{low}, {high}]")
  return float(value)


def _stop_strings(body: dict) -> tuple[str, ...]:
  """OpenAI's `stop`: absent / null, a string, or a list of up to
  `MAX_STOPS` strings; anything else is a 400."""
  stop = body.get("stop")
  if stop is None:
    return ()
  stops = [stop] if isinstance(stop, str) else stop
  if not (isinstance(stops, list) and len(stops) <= MAX_STOPS and all(
      isinstance(s, str) and s for s in stops)):
    raise RequestError(f"'stop' must be a non-empty string or a list of up "
                       f"to {MAX_STOPS} non-empty strings")
  return tuple(stops)


def parse_chat_request(body: Any, max_tokens_limit: int) -> ChatRequest:
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
  if body.get("n", 1) != 1:
    raise RequestError("only n=1 is supported")
  if not isinstance(body.get("stream", False), bool):
    raise RequestError("'stream' must be true or false")
  return ChatRequest(
      [{"role": m["role"], "content": m["content"]} for m in messages],
      _number(body, "temperature", 0.0, 0.0, 2.0),
      _number(body, "top_p", 1.0, 1e-6, 1.0),
      int(_number(body, "max_tokens", min(256, max_tokens_limit), 1,
                  max_tokens_limit)),
      bool(body.get("stream", False)), _stop_strings(body))


def _error(status: int, message: str, headers: dict[str, str] | None = None,
           code: str | int | None = None) -> JSONResponse:
  headers = dict(headers or {})
  if status in (401, 408, 413):  # The body may be unread: do not reuse.
    headers["Connection"] = "close"
  return JSONResponse({"error": {"message": message,
                                 "code": status if code is None else code}},
                      status, headers=headers)


class ModelNotFound(RequestError):
  """A request for a model this server does not serve (OpenAI: 404
  `model_not_found`)."""

  def __init__(self, asked: str, served: str):
    super().__init__(f"the model {asked!r} does not exist; this server "
                     f"serves {served!r}", 404)


def check_model(body: Any, served: str) -> None:
  """A request naming another model than `served` is refused (an absent or
  empty name means the served one)."""
  asked = body.get("model") if isinstance(body, dict) else None
  if asked not in (None, "", served):
    raise ModelNotFound(str(asked), served)


def bearer_token(header: str) -> str | None:
  """The token of an `Authorization: Bearer <token>` header (the scheme is
  case-insensitive, RFC 9110)."""
  scheme, _, token = header.strip().partition(" ")
  return token.strip() if scheme.lower() == "bearer" else None


async def read_json(request: Request, limits: Limits) -> Any:
  """The request body as JSON, within the size and time limits."""
  declared = request.headers.get("content-length")
  if declared is not None and int(declared) > limits.max_request_bytes:
    raise RequestError(f"body of {declared} bytes exceeds the limit of "
                       f"{limits.max_request_bytes}", 413)
  chunks, size = [], 0

  async def receive() -> None:
    nonlocal size
    try:
      async for chunk in request.stream():
        size += len(chunk)
        if size > limits.max_request_bytes:
          raise RequestError(f"body exceeds the limit of "
                             f"{limits.max_request_bytes} bytes", 413)
        chunks.append(chunk)
    except ClientDisconnect:
      raise ClientGone(f"after {size} bytes of its body") from None

  try:
    await asyncio.wait_for(receive(), limits.body_timeout_s)
  except TimeoutError:
    raise RequestError(f"body not received within {limits.body_timeout_s} "
                       "s", 408) from None
  try:
    return json.loads(b"".join(chunks) or b"null")
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise RequestError(f"invalid JSON: {e}") from e
  except RecursionError:
    raise RequestError("invalid JSON: nested too deeply") from None


def _sse(payload: dict) -> str:
  return f"data: {json.dumps(payload)}\n\n"


async def _stream_chunks(completion: Completion, header: dict
                         ) -> AsyncIterator[str]:
  """OpenAI `chat.completion.chunk` events. Generation is one jitted call,
  so the text arrives as one delta after the role delta."""
  chunk = {**header, "object": "chat.completion.chunk"}
  for delta, finish in (({"role": "assistant", "content": ""}, None),
                        ({"content": completion.text}, None),
                        ({}, completion.finish_reason)):
    yield _sse({**chunk, "choices": [{"index": 0, "delta": delta,
                                      "finish_reason": finish}]})
  yield "data: [DONE]\n\n"


Handler = Callable[[Request], Awaitable[Response]]


def make_app(batcher: ChatBatcher | None, encoder: Encoder | None,
             model_name: str, api_key: str | None, limits: Limits,
             ready: threading.Event | None = None) -> Starlette:
  """The ASGI app. `api_key`: required as `Authorization: Bearer <key>` on
  every route but /health (None: no key). `ready`: until it is set (the
  server compiling its programs), /health and chat answer 503."""
  # Host-side work off the event loop, one thread each: the tokenizer's
  # chat template and the encoder (which is not thread-safe).
  tokenize_pool = concurrent.futures.ThreadPoolExecutor(1, "tokenize")
  encode_pool = concurrent.futures.ThreadPoolExecutor(1, "encode")
  expected = api_key.encode() if api_key else None
  if ready is None:
    ready = threading.Event()
    ready.set()
  in_flight = 0

  def guarded(handler: Handler, authenticate: bool = True) -> Handler:
    @functools.wraps(handler)
    async def wrapped(request: Request) -> Response:
      token = bearer_token(request.headers.get("authorization", "")) or ""
      if authenticate and expected and not hmac.compare_digest(
          token.encode(), expected):
        return _error(401, "missing or wrong API key")
      try:
        return await handler(request)
      except ClientGone as e:
        client = request.client
        logging.info("client %s:%s disconnected %s (%s %s)",
                     client.host if client else "?",
                     client.port if client else "?", e, request.method,
                     request.url.path)
        return Response(status_code=400)  # Unsent: nobody is listening.
      except ModelNotFound as e:
        return _error(e.status, str(e), code="model_not_found")
      except RequestError as e:
        return _error(e.status, str(e), e.headers)
      except ValueError as e:  # E.g. a prompt over the length limit.
        return _error(400, str(e))
      except ShuttingDown as e:
        return _error(503, str(e))
      except Exception as e:  # noqa: BLE001 - reported, not hidden.
        logging.exception("request failed")
        return _error(500, f"{type(e).__name__}: {e}")
    return wrapped

  async def in_thread(pool: concurrent.futures.Executor, fn, *args, **kw):
    return await asyncio.get_running_loop().run_in_executor(
        pool, functools.partial(fn, *args, **kw))

  async def chat(request: Request) -> Response:
    nonlocal in_flight
    body = await read_json(request, limits)
    check_model(body, model_name)
    parsed = parse_chat_request(body, limits.max_new_tokens)
    if not ready.is_set():
      raise RequestError("the server is compiling its programs; retry "
                         "shortly", 503, {"Retry-After": "5"})
    if in_flight >= limits.max_pending:
      raise RequestError(f"{in_flight} chat requests pending (serve."
                         f"max_pending); retry later", 429,
                         {"Retry-After": "1"})
    in_flight += 1
    try:
      prompt = await in_thread(tokenize_pool, batcher.policy.encode,
                               parsed.messages)
      stop_tokens = [await in_thread(tokenize_pool,
                                     batcher.policy.stop_tokens, s)
                     for s in parsed.stop]
      completion: Completion = await asyncio.wrap_future(batcher.submit(
          prompt, parsed.temperature, parsed.top_p, parsed.max_tokens,
          parsed.stop, stop_tokens))
    finally:
      in_flight -= 1
    header = {"id": f"chatcmpl-{time.monotonic_ns()}",
              "created": int(time.time()), "model": model_name}
    if parsed.stream:
      return StreamingResponse(_stream_chunks(completion, header),
                               media_type="text/event-stream")
    return JSONResponse({
        **header, "object": "chat.completion",
        "choices": [{"index": 0, "finish_reason": completion.finish_reason,
                     "message": {"role": "assistant",
                                 "content": completion.text}}],
        "usage": {"prompt_tokens": completion.prompt_tokens,
                  "completion_tokens": completion.completion_tokens,
                  "total_tokens": (completion.prompt_tokens
                                   + completion.completion_tokens)}})

  async def embeddings(request: Request) -> Response:
    body = await read_json(request, limits)
    if not isinstance(body, dict):
      raise RequestError("request body must be a JSON object")
    check_model(body, model_name)
    texts = body.get("input")
    texts = [texts] if isinstance(texts, str) else texts
    if not isinstance(texts, list) or not texts:
      raise RequestError("'input' must be a string or a non-empty list of "
                         "strings")
    if len(texts) > limits.max_embedding_inputs:
      raise RequestError(f"{len(texts)} inputs exceed the limit of "
                         f"{limits.max_embedding_inputs} per request "
                         "(serve.max_embedding_inputs)", 413)
    if not all(isinstance(t, str) for t in texts):
      raise RequestError("'input' must be a string or a non-empty list of "
                         "strings")
    longest = max(len(t) for t in texts)
    if longest > limits.max_embedding_chars:
      raise RequestError(f"an input of {longest} characters exceeds the "
                         f"limit of {limits.max_embedding_chars} "
                         "(serve.max_embedding_chars)")
    kind = "query" if body.get("input_type") == "query" else "document"
    # One chunk per turn of the encode thread: a large request waits its
    # turn behind, and lets through, the other requests' chunks.
    step = max(1, limits.embedding_chunk)
    vectors = [v for first in range(0, len(texts), step)
               for v in await in_thread(encode_pool, encoder.encode,
                                        texts[first:first + step], kind=kind)]
    return JSONResponse({"object": "list", "model": model_name, "data": [
        {"object": "embedding", "index": i, "embedding": v.tolist()}
        for i, v in enumerate(vectors)],
        "usage": {"prompt_tokens": 0, "total_tokens": 0}})

  async def models(request: Request) -> Response:
    del request
    return JSONResponse({"object": "list", "data": [
        {"id": model_name, "object": "model", "owned_by": "cmimem_jax"}]})

  async def health(request: Request) -> Response:
    del request
    if not ready.is_set():
      return JSONResponse({"status": "warming_up"}, 503,
                          headers={"Retry-After": "5"})
    return JSONResponse({"status": "ok"})

  async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return _error(exc.status_code, f"{exc.detail}: {request.url.path}")

  routes = [Route("/health", guarded(health, authenticate=False)),
            Route("/v1/models", guarded(models))]
  if batcher is not None:
    routes.append(Route("/v1/chat/completions", guarded(chat),
                        methods=["POST"]))
  if encoder is not None:
    routes.append(Route("/v1/embeddings", guarded(embeddings),
                        methods=["POST"]))
  app = Starlette(routes=routes,
                  exception_handlers={HTTPException: http_error})
  app.state.pools = (tokenize_pool, encode_pool)
  return app
