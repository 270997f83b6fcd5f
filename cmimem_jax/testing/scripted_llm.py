"""A scripted stand-in for the recipe's external LLM (teacher, QA
synthesizer, judge) on loopback: an OpenAI-compatible `/v1/chat/completions`
that recognises each documented prompt by its opening line and answers it
in that prompt's documented format, built from the prompt's own text.

Where a tiny model cannot write the format a tool needs (JSON agent
operations, QA pairs, Listing 11 verdicts), this lets `tools/rehearse.py`
test the recipe's plumbing, not an LLM's quality. A prompt it does not
recognise gets HTTP 400, so a tool that sends an undocumented prompt fails
the rehearsal instead of passing on a made-up answer.

`--latency_s` makes every chat answer take that long and `--max_in_flight`
caps the requests it works on at once (later ones wait for a slot, as a
real server's batch does), so a client's concurrency is measured, not
assumed: `GET /stats` reports the requests, those in flight and the peak.

  python -m cmimem_jax.testing.scripted_llm --port=8001  # until Ctrl-C
  python -m cmimem_jax.testing.scripted_llm --port=8001 --latency_s=3 \
      --max_in_flight=64
"""

from __future__ import annotations

import collections
import json
import re
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from absl import app, flags

from cmimem_jax.config import run_command
from cmimem_jax.evaluation.metrics import normalize_answer
from cmimem_jax.memory.prompts import TEMPLATES
from cmimem_jax.task import qa_synthesis


def _opening(template: str) -> str:
  return template.splitlines()[0].split("{")[0].strip()


def _statements(text: str, limit: int = 2) -> list[str]:
  """The first user sentences of a rendered session (`user: ...` lines),
  without characters the DSL or JSON would need escaped."""
  found = []
  for line in text.splitlines():
    match = re.match(r"\s*(?:\[[^\]]*\]\s*)?user:\s*(.+)", line, re.I)
    if match:
      sentence = re.split(r"(?<=[.!?])\s", match.group(1))[0]
      found.append(re.sub(r"[|\"\\]", " ", sentence)[:160].strip())
    if len(found) == limit:
      break
  return found or ["The user said nothing new."]


def _field(text: str, pattern: str, default: str = "") -> str:
  match = re.search(pattern, text)
  return match.group(1).strip() if match else default


def _date(text: str) -> str:
  return _field(text, r"(\d{4}[-/]\d{2}[-/]\d{2})", "2024-01-01").replace(
      "/", "-")


def _pairs(n: int, session_name: str, session: str) -> list[dict]:
  statement = _statements(session, 1)[0]
  pairs = [{"question": f"What did the user say in {session_name}?",
            "answer": " ".join(statement.split()[:6]),
            "type": "single-session"},
           {"question": f"When did {session_name} take place?",
            "answer": _date(session), "type": "temporal"}]
  return (pairs * n)[:n]


def _qa_pairs(prompt: str) -> str:
  n = int(_field(prompt, r"Write exactly (\d+)", "1"))
  index = _field(prompt, r"Session (\d+) \(", "1")
  session = prompt.split(f"Session {index} (", 1)[-1]
  return json.dumps({"pairs": _pairs(n, f"session {index}", session)})


def _memory_qa_pairs(prompt: str) -> str:
  """MemBuilder's format (`qa_synthesis.MEMORY_PROMPT`)."""
  n = int(_field(prompt, r"Generate exactly (\d+)", "1"))
  session = prompt.split("(Newly Added):**", 1)[-1].split("\n---", 1)[0]
  pairs = [dict(p, type="temporal-reasoning") if p["type"] == "temporal"
           else p for p in _pairs(n, "the session", session)]
  return json.dumps({"questions": pairs})


def _verdict(prompt: str) -> str:
  gold = normalize_answer(_field(prompt, r"Gold answer: (.*)"))
  generated = normalize_answer(_field(prompt, r"Generated answer: (.*)"))
  label = "CORRECT" if gold and gold in generated else "WRONG"
  return f'Compared word for word. {{"label": "{label}"}}'


def _dsl(prompt: str) -> str:
  session = prompt.split("[Session #", 1)[-1]
  first, *rest = _statements(session)
  lines = [f"CORE:APPEND|{first}"]
  lines += [f"EPISODIC:ADD|{_date(session)}: {s}" for s in rest] or [
      "EPISODIC:SKIP"]
  return "\n".join(lines + ["SEMANTIC:SKIP", "PROCEDURAL:SKIP"])


def _answer(prompt: str) -> str:
  """Listing 10: the first retrieved memory (without its date stamp), else
  the first line of the source turns, else "Not answerable"."""
  memories = prompt.split("Retrieved Memories:", 1)[-1]
  first = re.search(r"^1\. (?:\[[^\]]*\] )?(.+)$", memories, re.M)
  if first:
    return first.group(1).strip()
  turns = _field(prompt, r"Supporting Original Conversations:\n(.*)")
  return turns or "Not answerable"


# Listing 10 opens with its optional additional context: found by the line
# after it.
_ANSWER_OPENING = "Core Memory (User Profile):"


def _messages_block(prompt: str) -> str:
  return prompt.split("New Messages:", 1)[-1]


# Opening line of each documented prompt -> its answer in its format.
REPLIES: dict[str, Callable[[str], str]] = {
    _opening(qa_synthesis.PROMPT): _qa_pairs,
    _opening(qa_synthesis.MEMORY_PROMPT): _memory_qa_pairs,
    _opening(TEMPLATES["judge"]): _verdict,
    _opening(TEMPLATES["policy_system"]): _dsl,
    _opening(TEMPLATES["core_agent"]): lambda p: json.dumps({
        "operation": "APPEND",
        "content": _statements(_messages_block(p), 1)[0]}),
    _opening(TEMPLATES["episodic_agent"]): lambda p: json.dumps({
        "operations": [{"action": "ADD",
                        "memory": f"{_date(p)}: {s} | Details: as said"}
                       for s in _statements(_messages_block(p))]}),
    _opening(TEMPLATES["semantic_agent"]): lambda p: json.dumps({
        "operations": [{"action": "SKIP", "reason": "nothing general"}]}),
    _opening(TEMPLATES["procedural_agent"]): lambda p: json.dumps(
        {"operations": []}),
    _opening(TEMPLATES["core_compression"]): lambda p: json.dumps({
        "content": _field(p, r"Current content:\n(.*)", "")[:1000]}),
    _opening(TEMPLATES["merge_summary"]): lambda p: _field(
        p, r"Memories to merge:\n(.*)", "merged"),
    _ANSWER_OPENING: _answer,
}


def reply(messages: list[dict]) -> str | None:
  """The scripted answer to a conversation, or None for a prompt that no
  tool of the recipe documents."""
  text = "\n".join(str(m.get("content", "")) for m in messages)
  for opening, answer in REPLIES.items():
    if text.lstrip().startswith(opening) or f"\n{opening}" in text[:200]:
      return answer(text)
  return None


class _HTTPServer(ThreadingHTTPServer):
  daemon_threads = True
  request_queue_size = 256  # Bursts of concurrent clients (default: 5).


class JSONHandler(BaseHTTPRequestHandler):
  """A quiet request handler that answers JSON bodies."""

  def log_message(self, *args: object) -> None:
    del args

  def _send(self, code: int, body: bytes) -> None:
    self.send_response(code)
    self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(len(body)))
    self.end_headers()
    try:
      self.wfile.write(body)
    except (BrokenPipeError, ConnectionResetError):
      pass  # The client gave up (e.g. its timeout): expected.

  def _send_json(self, code: int, payload: dict) -> None:
    self._send(code, json.dumps(payload).encode())


class LoopbackServer:
  """An HTTP server on loopback with `handler` (a
  `BaseHTTPRequestHandler` class), serving in a daemon thread while inside
  `with ...:`; `base_url` ends in `/v1`. (Also the test suite's fake
  OpenAI server.)"""

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

  def __exit__(self, *exc: object) -> None:
    self.httpd.shutdown()
    self.httpd.server_close()


class ScriptedLLM(LoopbackServer):
  """Serves in a daemon thread while inside `with ...:`; `base_url` ends in
  `/v1`; `counts` tallies the prompts answered by kind (and "unknown").

  Args:
    latency_s: seconds each chat answer takes (slept once it has a slot).
    max_in_flight: chat requests worked on at once (0: no cap); later ones
      wait for a slot.
  """

  def __init__(self, host: str = "127.0.0.1", port: int = 0,
               latency_s: float = 0.0, max_in_flight: int = 0):
    if latency_s < 0 or max_in_flight < 0:
      raise ValueError(f"latency_s ({latency_s}) and max_in_flight "
                       f"({max_in_flight}) must be >= 0")
    self.counts: collections.Counter[str] = collections.Counter()
    self.lock = threading.Lock()
    self.latency_s, self.max_in_flight = latency_s, max_in_flight
    self.in_flight = self.peak_in_flight = 0
    slots = (threading.BoundedSemaphore(max_in_flight) if max_in_flight
             else None)
    owner = self

    class Handler(JSONHandler):
      def do_GET(self) -> None:
        if self.path.rstrip("/").endswith("/stats"):
          self._send_json(200, owner.stats())
          return
        self._send_json(200, {"status": "ok"})

      def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", 0))
        request = json.loads(self.rfile.read(length) or b"{}")
        if not self.path.endswith("/chat/completions"):
          self._send_json(404, {"error": {"message":
                                          f"no route {self.path}"}})
          return
        if slots is not None:
          slots.acquire()
        try:
          with owner.lock:
            owner.in_flight += 1
            owner.peak_in_flight = max(owner.peak_in_flight,
                                       owner.in_flight)
          time.sleep(owner.latency_s)
          text = reply(request.get("messages", []))
          with owner.lock:
            owner.counts["unknown" if text is None else "answered"] += 1
        finally:
          with owner.lock:
            owner.in_flight -= 1
          if slots is not None:
            slots.release()
        if text is None:
          self._send_json(400, {"error": {
              "message": "scripted_llm: not a documented prompt"}})
          return
        self._send_json(200, {
            "id": "scripted", "object": "chat.completion", "created": 0,
            "model": request.get("model", "scripted"),
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": text}}]})

    super().__init__(Handler, host, port)

  def stats(self) -> dict[str, float | int]:
    """Chat requests answered / unknown, in flight now and at the peak, and
    the configured latency and cap (`GET /stats`)."""
    with self.lock:
      return {"answered": self.counts["answered"],
              "unknown": self.counts["unknown"],
              "in_flight": self.in_flight,
              "peak_in_flight": self.peak_in_flight,
              "latency_s": self.latency_s,
              "max_in_flight": self.max_in_flight}


FLAGS = flags.FlagValues()
flags.DEFINE_integer("port", 8001, "Port on 127.0.0.1.", flag_values=FLAGS)
flags.DEFINE_float("latency_s", 0.0, "Seconds each chat answer takes.",
                   flag_values=FLAGS)
flags.DEFINE_integer("max_in_flight", 0, "Chat requests worked on at once "
                     "(0: no cap); later ones wait.", flag_values=FLAGS)


def main(argv: list[str]) -> None:
  del argv
  args = FLAGS
  if args.latency_s < 0 or args.max_in_flight < 0:
    raise app.UsageError("--latency_s and --max_in_flight must be >= 0")
  with ScriptedLLM(port=args.port, latency_s=args.latency_s,
                   max_in_flight=args.max_in_flight) as server:
    print(f"ready at {server.base_url}", flush=True)
    try:
      threading.Event().wait()
    except KeyboardInterrupt:
      pass


if __name__ == "__main__":
  run_command(main, flag_values=FLAGS, compilation_cache=False)
