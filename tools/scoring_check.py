"""Checks `tools/plan.py --run`'s model of a GRPO step's scoring stage on
this CPU: trains `configs/tiny.py` (grammar-constrained rollouts, so they
are valid and ask questions) with the LLM judge, whose answer model and
judge are two latency stand-ins (`tools/scripted_llm.py --latency_s`),
and prints, per step, the scoring time the trainer measured (`reward_s`)
beside the plan's `(ceil(N / C) + 1) x L` for that step's N answer calls
(`plan.endpoint_rounds`) and the old serial scoring's `2 x valid
rollouts x L`.

  python tools/scoring_check.py --latency_s=0.2 --concurrency=8 --steps=3
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from scripted_llm import ScriptedLLM  # noqa: E402


def main(argv: list[str] | None = None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--latency_s", type=float, default=0.2)
  parser.add_argument("--concurrency", type=int, default=8)
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--workdir", default="",
                      help="the training run's directory (default: a "
                      "temporary one)")
  args = parser.parse_args(argv)
  if args.latency_s <= 0 or args.concurrency < 1 or args.steps < 1:
    parser.error("--latency_s must be > 0, --concurrency and --steps >= 1")
  from cmimem_jax.data import bundled_path, load_dataset
  from cmimem_jax.rl import read_metrics, read_rollouts
  from cmimem_jax.task.episode import session_questions
  import plan

  with tempfile.TemporaryDirectory() as scratch, ScriptedLLM(
      latency_s=args.latency_s) as answers, ScriptedLLM(
          latency_s=args.latency_s) as judges:
    workdir = args.workdir or os.path.join(scratch, "run")
    overrides = {
        "qa.judge": "llm", "rollout.constrained_dsl": True,
        "rollout.max_new_tokens": 64, "rl.max_steps": args.steps,
        "rl.log_rollouts": True, "checkpoint.every_steps": args.steps}
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
    stats = answers.stats(), judges.stats()
    metrics, rollouts = read_metrics(workdir), read_rollouts(workdir)
  questions = {}
  for dialogue in load_dataset("longmemeval", bundled_path()):
    for session in dialogue.sessions:
      questions[f"{dialogue.dialogue_id}/{session.index}"] = len(
          session_questions(dialogue, session))
  calls: collections.Counter[int] = collections.Counter()
  valid: collections.Counter[int] = collections.Counter()
  for record in rollouts:
    if record["valid"]:
      valid[record["step"]] += 1
      calls[record["step"]] += questions[record["session"]]
  if sum(calls.values()) != stats[0]["answered"]:
    sys.exit(f"error: {stats[0]['answered']} answer calls reached the "
             f"stand-in, {sum(calls.values())} expected from the rollouts")
  config = plan._load_config(os.path.join(ROOT, "configs", "tiny.py"))
  config.qa.judge = "llm"
  rows = []
  for record in metrics:
    step = record["step"]
    rounds = plan.endpoint_rounds(config, calls[step], 1, args.concurrency)
    rows.append({
        "step": step, "valid_rollouts": valid[step],
        "answer_calls": calls[step], "measured_s": round(record["reward_s"],
                                                         3),
        "model_s": round(rounds * args.latency_s, 3),
        "serial_s": round(2 * valid[step] * args.latency_s, 3),
        "concurrency": args.concurrency, "latency_s": args.latency_s,
        "peak_in_flight": [s["peak_in_flight"] for s in stats]})
    print(json.dumps(rows[-1]), flush=True)
  return rows


if __name__ == "__main__":
  main()
