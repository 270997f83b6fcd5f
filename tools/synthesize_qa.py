"""Synthesizes per-session QA pairs for RL training (paper Table 5; the
MemBuilder protocol: single-session, multi-session and temporal questions).

  python tools/synthesize_qa.py --input=DATA.json --output=DATA_qa.json \
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

What the model is shown:
* `--expert_states=DIR` (the paper's protocol: its training data is
  "synthesized by deepseek-v4-pro following the protocol of Shen et al.
  (2026)", i.e. MemBuilder's): the expert memory state `M_{t-1}` before
  each session, as `tools/build_expert_states.py` saved it
  (`DIR/<question_id>/s<t>/`; build the states from the QA-less records
  first), rendered into MemBuilder's prompt (`MEMORY_PROMPT`). MemBuilder
  (github.com/Zh1yuShen/MemBuilder @ 422d053): `prompts.py:375-470`
  (`QA_GENERATION_PROMPT`, ported verbatim: the core block, then every
  episodic, semantic and procedural memory, one a line, then the session
  and its timestamp; 50% single-session, 30% multi-session, 20%
  temporal-reasoning); `qa_generator.py:33-91` (`generate_qa`: 5 questions
  by default, temperature 0.0, `{"questions": [...]}` answers);
  `scripts/prepare_rl_data.py:189-207` (the README's `--add-qa
  --qa-per-session 5` path: the state is the session's
  `state_before_path`, all stored memories, not a retrieved top-k). Its
  other entry point, `qa_generator.py:189-316`
  (`generate_qa_from_trajectories`), loads the state *after* the session
  (`state_{N+1}`); we follow `prepare_rl_data.py`, whose state matches
  the prompt's "Memory State from Previous Steps" and the states the
  trainer reads (the last session's after-state is never built). Departures:
  turns are rendered `user: ...` (MemBuilder: `[REAL_USER]: ...`), the
  `source` field is dropped and MemBuilder's `temporal-reasoning` is
  stored as our `temporal` (`parse_pairs`). The default temperature is
  MemBuilder's 0.0.
* without it (a cheaper stand-in when no expert states exist): our own
  prompt (`PROMPT`) over the session, its date and the last 3,000
  characters of the earlier sessions (600 of each), temperature 0.7.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from cmimem_jax.client import EndpointConfig, OpenAIClient  # noqa: E402
from cmimem_jax.data.files import (path_under, read_jsonl,  # noqa: E402
                                   write_json)
from cmimem_jax.evaluation.run import file_sha256  # noqa: E402
from cmimem_jax.memory.bank import MemoryBank  # noqa: E402
from cmimem_jax.memory.json_agents import loads_llm_json  # noqa: E402
from cmimem_jax.memory.types import MemoryType  # noqa: E402
from cmimem_jax.task.snapshots import STATES_FILE  # noqa: E402

QA_TYPES = ("single-session", "multi-session", "temporal")
# Beside `--output`: each finished session's pairs, as they arrive.
PROGRESS_SUFFIX = ".progress.jsonl"
# MemBuilder's type names that mean one of ours.
QA_TYPE_ALIASES = {"temporal-reasoning": "temporal"}

PROMPT = """\
You write evaluation questions for a personal assistant's long-term memory.
Below is session {index} of a conversation between a user and an assistant,
dated {date}, preceded by a summary of the earlier sessions.

Earlier sessions:
{history}

Session {index} ({date}):
{session}

Write exactly {n} question-answer pairs that can be answered only by
remembering this session: mostly "single-session" facts about the user from
this session, at least one "temporal" question about when something
happened (use the session date), and, when the earlier sessions allow, one
"multi-session" question combining this session with an earlier one.
Answers are short (a few words). Return only JSON:
{{"pairs": [{{"question": "...", "answer": "...",
             "type": "single-session|multi-session|temporal"}}]}}"""

# MemBuilder's QA_GENERATION_PROMPT (prompts.py:375-470 @ 422d053), verbatim.
MEMORY_PROMPT = """\
You are an expert at generating precise, specific verification questions for testing memory systems.

**EVALUATION SCENARIO:**
You are creating questions to test a memory system. Here's how the evaluation works:

1. **Memory Building Phase (Already Done)**: A memory system has processed the conversation history up to this point and stored memories in a vector database.

2. **Question Answering Phase (What You're Preparing For)**: 
   - The answering model will receive ONLY your question
   - The answering model will search the memory database using your question as a query
   - The answering model will retrieve relevant memories (episodic, semantic, procedural)
   - The answering model will answer based ONLY on retrieved memories
   - **CRITICAL**: The answering model CANNOT see the original conversation text

3. **Your Task**: Generate questions that:
   - Test whether the memory system correctly captured information from the current session
   - Include enough context/anchors so the question itself can retrieve the right memories
   - Are answerable using only the information stored in the memory database

**Memory State from Previous Steps (All Retrieved Memories):**

Core Memory:
{core_memory}

Episodic Memories (事件记忆):
{episodic_memories}

Semantic Memories (概念记忆):
{semantic_memories}

Procedural Memories (过程记忆):
{procedural_memories}

**Current Session Conversation (Newly Added):**
{current_session}

Session Timestamp: {session_timestamp}

---

**QUESTION GENERATION GUIDELINES:**

**Critical Rules:**

1. **Use First Person Perspective**: All questions MUST be phrased from the user's perspective using "I/my/me".
   - ✅ CORRECT: "What is my favorite hobby?"
   - ❌ WRONG: "What is the user's favorite hobby?"

2. **Ask About Facts, NOT Opinions**: Questions must have objective, verifiable answers.
   - ✅ CORRECT: "What city did I visit last month?" (factual, verifiable)
   - ❌ WRONG: "How do I feel about my job?" (subjective, opinion-based)

3. **Single Retrievable Answer**: Each question should have ONE clear answer that can be found through memory search.

4. **Natural Question Phrasing**: Use conversational, natural language

5. **Be Specific with Anchors**: Each question MUST include specific anchoring information (names, dates, places, events, products, activities) to help retrieve the correct memories.

6. **Avoid Vague Reasoning**: Do NOT ask abstract relationship questions like "How does X relate to Y?"

7. **Concrete Facts Only**: Focus on verifiable, concrete facts that have clear, unambiguous answers.

**Question Types:**
- **current_session**: Ask about NEW information from the current session
- **cross_session**: Connect current session mentions with historical details

**QUESTION TYPES AND DISTRIBUTION:**
Generate exactly {num_questions} questions with the following distribution:

1. **single-session** (Target: 50% = 2-3 questions)
   - Tests memory retention from current session ONLY
   - Information found ONLY in the current session

2. **multi-session** (Target: 30% = 1-2 questions)
   - Requires information from MULTIPLE sessions
   - Needs to aggregate/count/compare across sessions

3. **temporal-reasoning** (Target: 20% = 1 question)
   - Involves time calculation, date comparison, or event ordering
   - Requires reasoning about temporal relationships

**OUTPUT FORMAT:**
Return a JSON object with this EXACT structure:
{{
  "questions": [
    {{
      "question": "What is my favorite hobby?",
      "answer": "Photography",
      "type": "single-session|multi-session|temporal-reasoning|knowledge-update",
      "source": "current_session|cross_session"
    }},
    ... (exactly {{num_questions}} questions total)
  ]
}}

Return ONLY the JSON object, no additional text."""


def session_text(turns: list[dict]) -> str:
  return "\n".join(f"{t['role']}: {t['content']}" for t in turns)


def parse_pairs(text: str, n: int) -> list[dict] | None:
  """The first n well-formed pairs, or None if there are none. Reads our
  `{"pairs": [...]}` (`PROMPT`) and MemBuilder's `{"questions": [...]}`
  (`MEMORY_PROMPT`); types outside `QA_TYPES` and its aliases count as
  single-session."""
  try:
    value = loads_llm_json(text)
  except ValueError:
    return None
  items = (value.get("pairs", value.get("questions"))
           if isinstance(value, dict) else None)
  pairs = []
  for item in items if isinstance(items, list) else []:
    if (isinstance(item, dict) and str(item.get("question", "")).strip()
        and str(item.get("answer", "")).strip()):
      kind = QA_TYPE_ALIASES.get(item.get("type"), item.get("type"))
      pairs.append({"question": str(item["question"]).strip(),
                    "answer": str(item["answer"]).strip(),
                    "type": kind if kind in QA_TYPES else "single-session"})
  return pairs[:n] or None


def memory_state_text(bank: MemoryBank) -> dict[str, str]:
  """`MEMORY_PROMPT`'s memory fields for one state: the core block and
  every stored entry of each type, one a line (MemBuilder's placeholders
  for an empty slot)."""
  def lines(memory_type: MemoryType) -> str:
    return "\n".join(e.text for e in bank.entries(memory_type)) or "[None]"
  return {"core_memory": bank.core.strip() or "[Empty]",
          "episodic_memories": lines(MemoryType.EPISODIC),
          "semantic_memories": lines(MemoryType.SEMANTIC),
          "procedural_memories": lines(MemoryType.PROCEDURAL)}


def load_expert_states(directory: str, records: list[dict]
                       ) -> list[list[MemoryBank]]:
  """`banks[r][t]`: the expert state before session t of record r
  (`DIR/<question_id>/s<t>/`, written by `tools/build_expert_states.py`).

  Raises:
    ValueError: no expert states there, or some session's state missing.
  """
  if not os.path.exists(os.path.join(directory, STATES_FILE)):
    raise ValueError(f"--expert_states={directory!r} holds no expert states "
                     f"({STATES_FILE} missing): build them with "
                     "tools/build_expert_states.py")
  paths = [[path_under(directory, record["question_id"], f"s{t}")
            for t in range(len(record["haystack_sessions"]))]
           for record in records]
  missing = [os.path.relpath(p, directory) for per_record in paths
             for p in per_record
             if not os.path.exists(os.path.join(p, "CURRENT"))]
  if missing:
    raise ValueError(f"{len(missing)} session states missing in {directory} "
                     f"(first: {missing[:3]}): finish them with "
                     "tools/build_expert_states.py")
  return [[MemoryBank.load(p) for p in per_record] for per_record in paths]


def session_prompts(records: list[dict], per_session: int,
                    history_chars: int = 3000,
                    states: list[list[MemoryBank]] | None = None
                    ) -> list[tuple[tuple[int, str], list[dict]]]:
  """`((record index, session id), messages)` of every session: with
  `states` (`banks[r][t]`, `load_expert_states`) `MEMORY_PROMPT` over that
  state, else `PROMPT` over the last `history_chars` of the earlier
  sessions."""
  jobs = []
  for r, record in enumerate(records):
    history = []
    for s, (sid, date, turns) in enumerate(zip(
        record["haystack_session_ids"], record["haystack_dates"],
        record["haystack_sessions"])):
      text = session_text(turns)
      if states is not None:
        content = MEMORY_PROMPT.format(
            **memory_state_text(states[r][s]), current_session=text,
            session_timestamp=date, num_questions=per_session)
      else:
        content = PROMPT.format(
            index=s + 1, date=date, n=per_session, session=text,
            history="\n".join(history)[-history_chars:] or "(none)")
      jobs.append(((r, sid), [{"role": "user", "content": content}]))
      history.append(f"[{date}] {text[:600]}")
  return jobs


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
  in `progress`, a wave of `concurrency` calls at a time, keeping each
  wave's pairs as it returns; stops between waves when `stop` is set.
  Returns this run's counts."""
  stats: collections.Counter[str] = collections.Counter()
  pending = [job for job in jobs if job[0] not in progress.done]
  stats["kept_from_earlier_runs"] = len(jobs) - len(pending)
  wave = max(1, client.config.concurrency)
  first_error = ""
  for start in range(0, len(pending), wave):
    if stop is not None and stop.signum is not None:
      break
    chunk = pending[start:start + wave]
    results = client.chat_many([messages for _, messages in chunk])
    for (key, _), result in zip(chunk, results):
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


def _settings(args: argparse.Namespace, temperature: float) -> dict:
  """What the pairs depend on (not the endpoint's address, concurrency,
  timeouts or answer budget: a rerun against another host of the same
  model, or with a budget the server accepts, continues)."""
  return {"input_sha256": file_sha256(args.input), "model": args.model,
          "per_session": args.per_session, "temperature": temperature,
          "expert_states": os.path.abspath(args.expert_states)
          if args.expert_states else ""}


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--input", required=True)
  parser.add_argument("--output", default="")
  parser.add_argument("--base_url", default="http://127.0.0.1:8000/v1")
  parser.add_argument("--model", required=True)
  parser.add_argument("--per_session", type=int, default=5)
  parser.add_argument("--concurrency", type=int, default=8)
  parser.add_argument("--timeout_s", type=float, default=120.0)
  parser.add_argument(
      "--max_tokens", type=int, default=1024,
      help="answer budget per session (tokens; at most the server's cap)")
  parser.add_argument(
      "--expert_states", default="",
      help="directory of tools/build_expert_states.py: condition each "
      "session's questions on its expert memory state (MemBuilder's, the "
      "paper's protocol)")
  parser.add_argument(
      "--temperature", type=float, default=None,
      help="sampling temperature (default: 0.0 with --expert_states, as "
      "MemBuilder; 0.7 without)")
  parser.add_argument(
      "--max_failure_rate", type=float, default=0.0,
      help="write the output although up to this fraction of the sessions "
      "failed (they get no pairs); above it, exit 1 and keep the pairs "
      "made for a rerun")
  args = parser.parse_args(argv)
  if args.max_tokens < 1:
    parser.error("--max_tokens must be >= 1")
  if not 0.0 <= args.max_failure_rate <= 1.0:
    parser.error("--max_failure_rate must be in [0, 1]")
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
  main()
