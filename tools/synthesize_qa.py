"""Synthesizes per-session QA pairs for RL training (paper Table 5; the
MemBuilder protocol: single-session, multi-session and temporal questions).

  python tools/synthesize_qa.py --input=DATA.json --output=DATA_qa.json \
      --base_url=http://127.0.0.1:8000/v1 --model=NAME [--per_session=5] \
      [--max_tokens=1024]

Reads LongMemEval-format records, asks an OpenAI-compatible chat model for
`--per_session` QA pairs about each session (given the session, its date
and the earlier sessions; each answer at most `--max_tokens` tokens: keep
it within the server's own cap, e.g. 512 for `configs/serve_cpu.py`, or
every call is refused), and writes the records with a `session_qa`
field (`{session_id: [{question, answer, type}]}`) to `--output` (default:
`DATA_qa.json` next to the input). Sessions whose generation fails after
retries, or whose answer is not a JSON list of pairs, get no pairs; they
are counted and reported (a JSON line on stdout), never invented. A run
that synthesizes no pair at all writes nothing and exits 1 with the reason
on one line.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from cmimem_jax.client import EndpointConfig, OpenAIClient  # noqa: E402
from cmimem_jax.memory.json_agents import loads_llm_json  # noqa: E402

QA_TYPES = ("single-session", "multi-session", "temporal")

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


def session_text(turns: list[dict]) -> str:
  return "\n".join(f"{t['role']}: {t['content']}" for t in turns)


def parse_pairs(text: str, n: int) -> list[dict] | None:
  """The first n well-formed pairs, or None if there are none."""
  try:
    value = loads_llm_json(text)
  except ValueError:
    return None
  items = value.get("pairs") if isinstance(value, dict) else None
  pairs = []
  for item in items if isinstance(items, list) else []:
    if (isinstance(item, dict) and str(item.get("question", "")).strip()
        and str(item.get("answer", "")).strip()):
      kind = item.get("type")
      pairs.append({"question": str(item["question"]).strip(),
                    "answer": str(item["answer"]).strip(),
                    "type": kind if kind in QA_TYPES else "single-session"})
  return pairs[:n] or None


def synthesize(records: list[dict], client: OpenAIClient, per_session: int,
               history_chars: int = 3000) -> tuple[list[dict], dict]:
  stats: collections.Counter[str] = collections.Counter()
  jobs, prompts = [], []
  for r, record in enumerate(records):
    history = []
    for s, (sid, date, turns) in enumerate(zip(
        record["haystack_session_ids"], record["haystack_dates"],
        record["haystack_sessions"])):
      text = session_text(turns)
      prompts.append([{"role": "user", "content": PROMPT.format(
          index=s + 1, date=date, n=per_session, session=text,
          history="\n".join(history)[-history_chars:] or "(none)")}])
      jobs.append((r, sid))
      history.append(f"[{date}] {text[:600]}")
  results = client.chat_many(prompts)
  out = [dict(record, session_qa={}) for record in records]
  first_error = ""
  for (r, sid), result in zip(jobs, results):
    pairs = parse_pairs(result.text, per_session) if result.ok else None
    if pairs is None:
      stats["failed_sessions"] += 1
      first_error = first_error or " ".join(
          (result.error or "an answer without JSON pairs").split())
      continue
    out[r]["session_qa"][sid] = pairs
    stats["sessions"] += 1
    stats["pairs"] += len(pairs)
  if first_error:
    stats["first_error"] = first_error
  return out, {**stats, **client.failures.as_dict()}


def nothing_synthesized(stats: dict, max_tokens: int) -> str:
  """Why a run produced no pair, in one line."""
  if not stats.get("failed_sessions"):
    return "the input holds no sessions"
  reason = (f"all {stats['failed_sessions']} sessions failed (failed calls "
            f"{stats.get('failed_calls', {})}; first: {stats['first_error']})")
  if "http_4xx" in stats.get("failed_calls", {}):
    reason += (f"; is --max_tokens={max_tokens} above the server's cap? "
               "lower it")
  return reason


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
  args = parser.parse_args(argv)
  if args.max_tokens < 1:
    parser.error("--max_tokens must be >= 1")
  with open(args.input) as f:
    records = json.load(f)
  client = OpenAIClient(EndpointConfig(
      base_url=args.base_url, model=args.model, timeout_s=args.timeout_s,
      concurrency=args.concurrency, temperature=0.7,
      max_tokens=args.max_tokens))
  out, stats = synthesize(records, client, args.per_session)
  if not stats.get("pairs"):
    print(json.dumps(stats))
    sys.exit(f"error: no QA pairs synthesized, nothing written: "
             f"{nothing_synthesized(stats, args.max_tokens)}")
  output = args.output or os.path.splitext(args.input)[0] + "_qa.json"
  with open(output, "w") as f:
    json.dump(out, f, indent=1)
  stats["output"] = output
  print(json.dumps(stats))
  return stats


if __name__ == "__main__":
  main()
