"""Synthesizes per-session QA pairs for RL training (paper Table 5; the
MemBuilder protocol: single-session, multi-session and temporal questions).

  python -m tools.synthesize_qa --input=DATA.json --output=DATA_qa.json \
      --base_url=http://127.0.0.1:8000/v1 --model=NAME --expert_states=DIR \
      --per_session=5 --max_tokens=1024 --temperature=0.0 --concurrency=8 \
      --timeout_s=120

The recipe's form (README; `tools/rehearse.py` runs it as written, with its
own paths and endpoints): the expert states are built first
(`tools/build_expert_states.py`, from the QA-less records), and every
flag after them shows its default (`--temperature`: 0.0 with
`--expert_states`, MemBuilder's; 0.7 without).

Reads LongMemEval-format records, asks an OpenAI-compatible chat model
for `--per_session` QA pairs about each session (each answer at most
`--max_tokens` tokens: keep it within the server's own cap, e.g. 512 for
`configs/serve_cpu.py`, or every call is refused), and writes the records
with a `session_qa` field (`{session_id: [{question, answer, type}]}`) to
`--output` (default: `DATA_qa.json` next to the input), atomically, once
every session has its pairs. Sessions whose call fails after retries, or
whose answer is not a JSON list of pairs, get no pairs; they are counted
and reported (a JSON line on stdout), never invented, and the run exits 1
with the reason on one line, naming the endpoint and how many failed,
and writes no output, unless `--max_failure_rate` accepts that many
(then they stay without pairs).

Nothing answered is lost: each session's pairs are appended to
`OUTPUT.progress.jsonl` as its wave of calls returns, and a rerun of the
same command asks only for the sessions not there (the failed ones). On
SIGTERM / Ctrl-C the calls in flight finish and are kept, and the run
exits 128 + the signal with one line saying what was kept (a second
Ctrl-C stops at once). A progress file of other settings (input, model,
`--per_session`, temperature, expert states) is refused; delete it to
synthesize again.

What the model is shown: `cmimem_jax.task.qa_synthesis` (the prompts,
ported from MemBuilder, and the departures).
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import os
import signal
import sys

from absl import app, flags

from cmimem_jax.client import EndpointConfig, OpenAIClient
from cmimem_jax.config import run_command
from cmimem_jax.data.files import read_jsonl, write_json
from cmimem_jax.evaluation.run import file_sha256
from cmimem_jax.task.qa_synthesis import (load_expert_states, parse_pairs,
                                          session_prompts)

# This tool's flags (its own: tools share flag names).
FLAGS = flags.FlagValues()
flags.DEFINE_string("input", None, "LongMemEval-format records.",
                    flag_values=FLAGS, required=True)
flags.DEFINE_string("output", "", "Records with their pairs (default: "
                    "DATA_qa.json next to the input).", flag_values=FLAGS)
flags.DEFINE_string("base_url", "http://127.0.0.1:8000/v1",
                    "The chat model's OpenAI-compatible URL.",
                    flag_values=FLAGS)
flags.DEFINE_string("model", None, "The chat model's name.",
                    flag_values=FLAGS, required=True)
flags.DEFINE_integer("per_session", 5, "QA pairs per session.",
                     flag_values=FLAGS)
flags.DEFINE_integer("concurrency", 8, "Calls in flight at once.",
                     flag_values=FLAGS)
flags.DEFINE_float("timeout_s", 120.0, "Per-call timeout.",
                   flag_values=FLAGS)
flags.DEFINE_integer("max_tokens", 1024, "Answer budget per session "
                     "(tokens; at most the server's cap).", flag_values=FLAGS)
flags.DEFINE_string(
    "expert_states", "", "Directory of tools/build_expert_states.py: "
    "condition each session's questions on its expert memory state "
    "(MemBuilder's, the paper's protocol).", flag_values=FLAGS)
flags.DEFINE_float("temperature", None, "Sampling temperature (default: "
                   "0.0 with --expert_states, as MemBuilder; 0.7 without).",
                   flag_values=FLAGS)
flags.DEFINE_float(
    "max_failure_rate", 0.0, "Write the output although up to this "
    "fraction of the sessions failed (they get no pairs); above it, exit 1 "
    "and keep the pairs made for a rerun.", flag_values=FLAGS)

# Beside `--output`: each finished session's pairs, as they arrive.
PROGRESS_SUFFIX = ".progress.jsonl"


class Progress:
  """The pairs of each finished session, appended to `path` (JSONL) as
  they arrive, so an interrupted run loses at most the calls in flight
  and a rerun asks only for the sessions not there. The first line holds
  the settings the pairs depend on; a file of other settings is refused
  (its pairs would not be this run's)."""

  def __init__(self, path: str, settings: dict):
    self.path = path
    self.done: dict[tuple[int, str], list[dict]] = {}
    lines = read_jsonl(path)  # A torn last line (a kill) is cut off.
    if lines and lines[0].get("settings") != settings:
      stored = lines[0].get("settings") or {}
      changed = sorted(k for k in set(stored) | set(settings)
                       if stored.get(k) != settings.get(k))
      raise ValueError(f"{path} holds QA pairs of other settings "
                       f"({', '.join(changed)}): delete it, or use another "
                       "--output")
    for line in lines[1:]:
      self.done[(line["record"], line["session_id"])] = line["pairs"]
    self._file = open(path, "a", encoding="utf-8")
    if not lines:
      self._append({"settings": settings})

  def _append(self, line: dict) -> None:
    self._file.write(json.dumps(line) + "\n")
    self._file.flush()
    os.fsync(self._file.fileno())

  def keep(self, key: tuple[int, str], pairs: list[dict]) -> None:
    self.done[key] = pairs
    self._append({"record": key[0], "session_id": key[1], "pairs": pairs})

  def close(self) -> None:
    self._file.close()


class StopRequested:
  """SIGTERM / SIGINT set `signum`; the calls in flight finish and are
  kept, then the run stops. A second Ctrl-C stops at once."""

  def __init__(self):
    self.signum: int | None = None

  def __enter__(self) -> StopRequested:
    self._previous = {s: signal.signal(s, self._handle)
                      for s in (signal.SIGTERM, signal.SIGINT)}
    return self

  def __exit__(self, *exc: object) -> None:
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)

  def _handle(self, signum: int, frame: object) -> None:
    del frame
    if self.signum is not None and signum == signal.SIGINT:
      raise KeyboardInterrupt
    self.signum = signum


def synthesize(jobs: list[tuple[tuple[int, str], list[dict]]],
               client: OpenAIClient, per_session: int, progress: Progress,
               stop: StopRequested | None = None) -> dict:
  """Asks `client` for the pairs of each job (`session_prompts`) not yet
  in `progress`, `concurrency` calls in flight at all times (the next sent
  as soon as one returns, not wave by wave), each session's pairs kept as
  its answer arrives. Once `stop` is set nothing more is sent and the
  calls in flight (already paid for) are kept. Returns this run's counts."""
  stats: collections.Counter[str] = collections.Counter()
  pending = [job for job in jobs if job[0] not in progress.done]
  stats["kept_from_earlier_runs"] = len(jobs) - len(pending)
  first_error = ""
  unsent = iter(pending)
  in_flight: dict[concurrent.futures.Future, tuple[int, str]] = {}

  def send() -> None:
    # Sent from here, not queued in the pool, so a stop sends no more.
    while (len(in_flight) < max(1, client.config.concurrency)
           and (stop is None or stop.signum is None)):
      job = next(unsent, None)
      if job is None:
        return
      in_flight[client.submit(job[1])] = job[0]

  send()
  while in_flight:
    done, _ = concurrent.futures.wait(
        in_flight, return_when=concurrent.futures.FIRST_COMPLETED)
    for future in done:
      key, result = in_flight.pop(future), future.result()
      stats["calls"] += 1
      pairs = parse_pairs(result.text, per_session) if result.ok else None
      if pairs is None:
        stats["failed_sessions"] += 1
        if result.ok:  # Answered, but not with JSON pairs.
          stats["unusable_answers"] += 1
        first_error = first_error or " ".join(
            (result.error or "an answer without JSON pairs").split())
        continue
      progress.keep(key, pairs)
    send()
  if first_error:
    stats["first_error"] = first_error
  return dict(stats)


def with_pairs(records: list[dict], done: dict[tuple[int, str], list[dict]]
               ) -> tuple[list[dict], dict]:
  """The records with their `session_qa` (the sessions in `done`, in the
  records' order), and the counts of sessions and pairs."""
  out, sessions, pairs = [], 0, 0
  for r, record in enumerate(records):
    session_qa = {}
    for sid in record["haystack_session_ids"]:
      if (r, sid) in done:
        session_qa[sid] = done[(r, sid)]
        sessions += 1
        pairs += len(done[(r, sid)])
    out.append(dict(record, session_qa=session_qa))
  return out, {"sessions": sessions, "pairs": pairs}


def failure_reason(stats: dict, max_tokens: int) -> str:
  """Why sessions failed, in a phrase: the failed calls by kind, the
  answers without pairs, the first error, and a hint when the server
  refused the answer budget."""
  calls = stats.get("failed_calls", {})
  parts = [f"{sum(calls.values())} calls failed {calls}" if calls else "",
           f"{stats['unusable_answers']} answers without JSON pairs"
           if stats.get("unusable_answers") else "",
           f"first: {stats.get('first_error', '?')}"]
  if "http_4xx" in calls:
    parts.append(f"is --max_tokens={max_tokens} above the server's cap? "
                 "lower it")
  return "; ".join(p for p in parts if p)


def _settings(args: flags.FlagValues, temperature: float) -> dict:
  """What the pairs depend on (not the endpoint's address, concurrency,
  timeouts or answer budget: a rerun against another host of the same
  model, or with a budget the server accepts, continues)."""
  return {"input_sha256": file_sha256(args.input), "model": args.model,
          "per_session": args.per_session, "temperature": temperature,
          "expert_states": os.path.abspath(args.expert_states)
          if args.expert_states else ""}


def main(argv: list[str]) -> dict:
  del argv
  args = FLAGS
  if args.max_tokens < 1:
    raise app.UsageError("--max_tokens must be >= 1")
  if not 0.0 <= args.max_failure_rate <= 1.0:
    raise app.UsageError("--max_failure_rate must be in [0, 1]")
  try:
    with open(args.input) as f:
      records = json.load(f)
    states = (load_expert_states(args.expert_states, records)
              if args.expert_states else None)
  except (OSError, ValueError) as e:
    sys.exit(f"error: {e}")
  temperature = args.temperature
  if temperature is None:
    temperature = 0.0 if states is not None else 0.7
  output = args.output or os.path.splitext(args.input)[0] + "_qa.json"
  client = OpenAIClient(EndpointConfig(
      base_url=args.base_url, model=args.model, timeout_s=args.timeout_s,
      concurrency=args.concurrency, temperature=temperature,
      max_tokens=args.max_tokens))
  jobs = session_prompts(records, args.per_session, states=states)
  try:
    progress = Progress(output + PROGRESS_SUFFIX,
                        _settings(args, temperature))
  except ValueError as e:
    sys.exit(f"error: {e}")
  interrupted = None
  try:
    with StopRequested() as stop:
      stats = synthesize(jobs, client, args.per_session, progress, stop)
      interrupted = stop.signum
  except KeyboardInterrupt:  # A second Ctrl-C: the wave in flight is lost.
    interrupted = signal.SIGINT
    stats = {}
  finally:
    progress.close()
  out, counts = with_pairs(records, progress.done)
  stats = {**stats, **counts, "total_sessions": len(jobs),
           **client.failures.as_dict()}
  kept = (f"{counts['sessions']} of {len(jobs)} sessions' pairs kept in "
          f"{progress.path}")
  if interrupted is not None:
    print(json.dumps(stats))
    print(f"stopped by {signal.Signals(interrupted).name}: {kept}; rerun "
          "the same command to continue", file=sys.stderr)
    sys.exit(128 + interrupted)
  missing = len(jobs) - counts["sessions"]
  if not counts["pairs"] or missing > args.max_failure_rate * len(jobs):
    print(json.dumps(stats))
    what = ("no QA pairs synthesized" if not counts["pairs"] else
            f"{missing} of {len(jobs)} sessions failed (more than "
            f"--max_failure_rate={args.max_failure_rate:g})")
    sys.exit(f"error: {what} at {args.base_url}, nothing written to "
             f"{output}: {failure_reason(stats, args.max_tokens)}; {kept}: "
             "a rerun asks only for the others")
  write_json(output, out)
  stats["output"] = output
  print(json.dumps(stats))
  return stats


if __name__ == "__main__":
  run_command(main, flag_values=FLAGS, compilation_cache=False)
