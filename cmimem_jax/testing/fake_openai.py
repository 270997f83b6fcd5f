"""A minimal OpenAI-compatible HTTP server on loopback for tests, with
deterministic injected failures.

`behaviour(content, attempt)` picks what to do with the n-th request
(1-based `attempt`) carrying the same last-message content: "ok",
"500" / "400" / "429" (that status), "timeout" (sleep past the client's timeout, then answer),
"malformed" (200 with a body that is not JSON), "empty" (200 without
choices). With `max_tokens_cap`, a chat request asking for more gets a 400,
as a real server with that cap answers.
"""

from __future__ import annotations

import collections
import json
import re
import threading
import time
import zlib
from collections.abc import Callable

import numpy as np

from cmimem_jax.evaluation.metrics import normalize_answer
from cmimem_jax.testing.scripted_llm import JSONHandler, LoopbackServer


def reply_for(content: str) -> str:
  """Judge prompts (Listing 11) get a verdict; anything else an answer."""
  gold = re.search(r"Gold answer: (.*)", content)
  generated = re.search(r"Generated answer: (.*)", content)
  if gold and generated:
    ok = normalize_answer(gold.group(1)) in normalize_answer(generated.group(1))
    label = "CORRECT" if ok else "WRONG"
    return f'The answer matches the gold. {{"label": "{label}"}}'
  return "It was in May 2023."


def embedding_for(text: str, dim: int = 16) -> list[float]:
  rng = np.random.default_rng(zlib.crc32(text.encode()))
  vector = rng.standard_normal(dim)
  return (vector / np.linalg.norm(vector)).tolist()


class FakeOpenAI(LoopbackServer):
  """Serves in a daemon thread while inside `with ...:`; `base_url` ends
  in `/v1`."""

  def __init__(self, behaviour: Callable[[str, int], str] = lambda c, a: "ok",
               delay_s: float = 1.0, reply: Callable[[str], str] = reply_for,
               max_tokens_cap: int | None = None):
    self.behaviour, self.delay_s, self.reply = behaviour, delay_s, reply
    self.max_tokens_cap = max_tokens_cap
    self.attempts: collections.Counter[str] = collections.Counter()
    self.lock = threading.Lock()
    self.requests = 0
    server = self

    class Handler(JSONHandler):
      def do_POST(self):
        length = int(self.headers.get("Content-Length", 0))
        request = json.loads(self.rfile.read(length))
        if self.path.endswith("/embeddings"):
          inputs = request["input"]
          inputs = [inputs] if isinstance(inputs, str) else inputs
          data = [{"object": "embedding", "index": i,
                   "embedding": embedding_for(t)} for i, t in enumerate(inputs)]
          self._send(200, json.dumps({"object": "list", "data": data,
                                      "model": request["model"]}).encode())
          return
        content = request["messages"][-1]["content"]
        with server.lock:
          server.requests += 1
          server.attempts[content] += 1
          attempt = server.attempts[content]
        action = server.behaviour(content, attempt)
        if server.max_tokens_cap is not None and request.get(
            "max_tokens", 0) > server.max_tokens_cap:
          action = "400"
        if action in ("500", "400", "429"):
          self._send(int(action), b'{"error": {"message": "injected"}}')
          return
        if action == "timeout":
          time.sleep(server.delay_s)
        if action == "malformed":
          self._send(200, b"{not json")
          return
        choices = [] if action == "empty" else [{
            "index": 0, "finish_reason": "stop",
            "message": {"role": "assistant",
                        "content": server.reply(content)}}]
        self._send(200, json.dumps({
            "id": "x", "object": "chat.completion", "created": 0,
            "model": request["model"], "choices": choices}).encode())

    super().__init__(Handler)
