"""Checks `tools/plan.py --run`'s model of a GRPO step's scoring stage,
and of its overlap with decoding, on this CPU: trains `configs/tiny.py`
(grammar-constrained rollouts, so they are valid and ask questions) with
the LLM judge, whose answer model and judge are two latency stand-ins
(`cmimem_jax.testing.scripted_llm --latency_s`), decoding each step in
waves of `--max_rows_per_wave` rows, twice at the same seed: scoring each
wave as it is decoded while the next decodes
(`rollout.score_beside_decoding`, what training runs) and scoring after
the last wave (the serial order).

It prints, per step, what the trainer measured in each run (`sample_s`:
decoding; `reward_s`: the scoring after it) beside the plan's model: the
serial scoring stage `(ceil(N / C) + 1) x L` for the step's N answer
calls (`task.scoring_rounds.call_rounds`), and the calls' rounds left
after the last wave when each wave's are sent as it is decoded
(`task.scoring_rounds.scoring_after_decoding`, with the run's own
measured seconds a wave), and the old serial scoring's `2 x valid
rollouts x L`. It exits non-zero if the two runs' rollouts
(`rollouts.jsonl`) or rewards differ.

  python -m tools.scoring_check --latency_s=0.2 --concurrency=4 --steps=3 \
      --max_rows_per_wave=4
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import tempfile

from absl import app, flags

from cmimem_jax.config import run_command
from cmimem_jax.data import bundled_path, load_dataset
from cmimem_jax.rl import read_metrics, read_rollouts
from cmimem_jax.sampling.sampler import wave_rows
from cmimem_jax.task.episode import session_questions
from cmimem_jax.task.scoring_rounds import call_rounds, scoring_after_decoding
from cmimem_jax.testing.scripted_llm import ScriptedLLM
from configs import tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# This tool's flags (its own: tools share flag names).
FLAGS = flags.FlagValues()
flags.DEFINE_float("latency_s", 0.2, "Seconds each stand-in call takes.",
                   flag_values=FLAGS)
flags.DEFINE_integer("concurrency", 8, "Answer and judge calls in flight "
                     "per endpoint.", flag_values=FLAGS)
flags.DEFINE_integer("steps", 3, "GRPO steps trained per run.",
                     flag_values=FLAGS)
flags.DEFINE_integer("max_rows_per_wave", 4, "Rows decoded at once (whole "
                     "groups of 4: configs/tiny.py's 12 rows a step in 3 "
                     "waves).", flag_values=FLAGS)
flags.DEFINE_integer("max_new_tokens", 64, "Tokens per rollout.",
                     flag_values=FLAGS)
flags.DEFINE_string("workdir", "", "Where the two training runs go "
                    "(default: a temporary directory).", flag_values=FLAGS)

# The two runs: scoring each wave beside the next one's decoding, and
# after the last wave.
ORDERS = {"beside": True, "serial": False}


def _train(args, workdir: str, beside: bool) -> dict:
  """One training run of configs/tiny.py on two fresh latency stand-ins:
  its metrics, rollout records and the stand-ins' stats."""
  with ScriptedLLM(latency_s=args.latency_s) as answers, ScriptedLLM(
      latency_s=args.latency_s) as judges:
    overrides = {
        "qa.judge": "llm", "rollout.constrained_dsl": True,
        "rollout.max_new_tokens": args.max_new_tokens,
        "rollout.max_rows_per_wave": args.max_rows_per_wave,
        "rollout.score_beside_decoding": beside,
        "rl.max_steps": args.steps, "rl.log_rollouts": True,
        "checkpoint.every_steps": args.steps}
    for section, server in (("answer", answers), ("judge_endpoint", judges)):
      overrides.update({f"qa.{section}.base_url": server.base_url,
                        f"qa.{section}.model": "stand-in",
                        f"qa.{section}.max_retries": 0,
                        f"qa.{section}.concurrency": args.concurrency})
    command = [sys.executable, "-m", "cmimem_jax.train",
               f"--config={ROOT}/configs/tiny.py", f"--workdir={workdir}",
               *(f"--config.{k}={v}" for k, v in overrides.items())]
    # One CPU device, as the command runs outside a test's fake devices.
    xla_flags = " ".join(
        flag for flag in os.environ.get("XLA_FLAGS", "").split()
        if "xla_force_host_platform_device_count" not in flag)
    env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS=xla_flags)
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True,
                          text=True)
    if done.returncode:
      sys.exit(f"error: training failed:\n{done.stderr[-3000:]}")
    with open(os.path.join(workdir, "rollouts.jsonl"), "rb") as f:
      raw = f.read()
    return {"metrics": read_metrics(workdir),
            "rollouts": read_rollouts(workdir), "raw_rollouts": raw,
            "stats": (answers.stats(), judges.stats())}


def _wave_calls(records: list[dict], questions: dict[str, int],
                wave: int) -> dict[int, list[int]]:
  """Answer calls of each decoding wave of each step: the valid rollouts'
  questions, `wave` consecutive rows (in the logged row order) a wave."""
  rows: dict[int, list[int]] = collections.defaultdict(list)
  for record in records:
    rows[record["step"]].append(
        questions[record["session"]] if record["valid"] else 0)
  return {step: [sum(calls[i:i + wave]) for i in range(0, len(calls), wave)]
          for step, calls in rows.items()}


def main(argv: list[str]) -> list[dict]:
  del argv
  args = FLAGS
  if (args.latency_s <= 0 or args.concurrency < 1 or args.steps < 1
      or args.max_rows_per_wave < 0 or args.max_new_tokens < 1):
    raise app.UsageError("--latency_s must be > 0, --concurrency, --steps "
                         "and --max_new_tokens >= 1, --max_rows_per_wave "
                         ">= 0")
  config = tiny.get_config()
  group = config.rollout.num_rollouts
  rows_per_step = config.rl.sessions_per_batch * group
  wave = min(wave_rows(rows_per_step, group, 1, args.max_rows_per_wave),
             rows_per_step)
  with tempfile.TemporaryDirectory() as scratch:
    runs = {name: _train(args, os.path.join(args.workdir or scratch, name),
                         beside)
            for name, beside in ORDERS.items()}
  beside, serial = runs["beside"], runs["serial"]
  if beside["raw_rollouts"] != serial["raw_rollouts"]:
    sys.exit("error: rollouts.jsonl differs between scoring beside "
             "decoding and after it")
  questions = {}
  for dialogue in load_dataset("longmemeval", bundled_path()):
    for session in dialogue.sessions:
      questions[f"{dialogue.dialogue_id}/{session.index}"] = len(
          session_questions(dialogue, session))
  wave_calls = _wave_calls(serial["rollouts"], questions, wave)
  for name, run in runs.items():
    answered = run["stats"][0]["answered"]
    if sum(map(sum, wave_calls.values())) != answered:
      sys.exit(f"error: {answered} answer calls reached the {name} run's "
               f"stand-in, {sum(map(sum, wave_calls.values()))} expected "
               "from the rollouts")
  valid = collections.Counter(r["step"] for r in serial["rollouts"]
                              if r["valid"])
  rows = []
  for ours, theirs in zip(beside["metrics"], serial["metrics"]):
    step, calls = ours["step"], wave_calls[ours["step"]]
    if ours["reward_mean"] != theirs["reward_mean"]:
      sys.exit(f"error: step {step}'s rewards differ between the orders")
    if ours["decode_waves"] != len(calls):
      sys.exit(f"error: step {step} decoded {ours['decode_waves']} waves, "
               f"{len(calls)} expected")
    # The model from the run's own decoding: its waves are equal.
    wave_s = ours["sample_s"] / len(calls)
    after = scoring_after_decoding(calls, args.concurrency, args.latency_s,
                                   wave_s)
    rows.append({
        "step": step, "waves": len(calls), "wave_calls": calls,
        "valid_rollouts": valid[step], "answer_calls": sum(calls),
        "serial": {"decode_s": round(theirs["sample_s"], 3),
                   "scoring_s": round(theirs["reward_s"], 3),
                   "total_s": round(theirs["sample_s"] + theirs["reward_s"],
                                    3)},
        "beside": {"decode_s": round(ours["sample_s"], 3),
                   "scoring_after_s": round(ours["reward_s"], 3),
                   "wave_scoring_s": round(ours["wave_scoring_s"], 3),
                   "total_s": round(ours["sample_s"] + ours["reward_s"], 3)},
        "model": {
            "scoring_s": round(call_rounds(
                sum(calls), args.concurrency) * args.latency_s, 3),
            "scoring_after_s": round(after, 3),
            "beside_total_s": round(ours["sample_s"] + after, 3)},
        "old_serial_scoring_s": round(2 * valid[step] * args.latency_s, 3),
        "concurrency": args.concurrency, "latency_s": args.latency_s,
        "peak_in_flight": {name: [s["peak_in_flight"] for s in run["stats"]]
                           for name, run in runs.items()}})
    print(json.dumps(rows[-1]), flush=True)
  return rows


if __name__ == "__main__":
  run_command(main, flag_values=FLAGS, compilation_cache=False)
