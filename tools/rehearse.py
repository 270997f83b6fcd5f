"""The paper's recipe, rehearsed end to end on this CPU before a TPU run.

Runs every stage a TPU user runs, as README.md and the configs' docstrings
tell them to, each a real subprocess of the documented command with the
same configs (`configs/qwen3_4b.py`, `configs/qwen3_4b_tpu.py` on 8 fake
devices, `configs/eval_qwen3_4b.py`). Only sizes, paths and endpoints are
overridden, all in `RECIPE_OVERRIDES` below (tests/test_rehearse.py checks
each key against an allow-list, so a rehearsal cannot pass by changing
behaviour).

Stand-ins for what this machine lacks (`cmimem_jax.testing.standins`,
`cmimem_jax.testing.scripted_llm`): random-weight HF checkpoints shaped like
Qwen3-4B-Instruct and Qwen3-Embedding with their own tokenizer (not
SmolLM2's: a tokenizer mix-up fails), our own server
(`python -m cmimem_jax.serve`) as the QA answer model, and a scripted
OpenAI-compatible endpoint for the teacher, the QA synthesizer and the
judge, whose formats a tiny model cannot write.

Stages, in the recipe's order (README): standins -> serve ->
build_expert_states (from the QA-less records) -> synthesize_qa (each
session's questions on its expert state, `--expert_states`) ->
skip_calibration (the Semantic SKIP thresholds of the stand-in encoder, in
the rehearsal's own table: its identity is the real Qwen3-Embedding's) ->
bucket (the dataset and the expert states copied to a bucket, as
`gcloud storage cp -r` would) -> train (SIGTERM in the middle of step 1,
then the same command resumes; the metrics hold steps 1..N once each) ->
evaluate (at a kept checkpoint step, the LLM judge; no transport failures)
-> compare_paper. Train, evaluate and compare_paper run on the bucket as
the TPU config documents (`--workdir=gs://...`): a GCS emulator
(`cmimem_jax.testing.gcs_emulator`, fake-gcs-server) holds it, every
client pointed there by `STORAGE_EMULATOR_HOST`. One line per stage, then
a table; the exit status is non-zero and names the first stage that
failed.

  python -m tools.rehearse --workdir=DIR     # or: make rehearsal
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from absl import flags

from cmimem_jax import storage
from cmimem_jax.config import run_command
from cmimem_jax.rl import read_metrics
from cmimem_jax.testing.gcs_emulator import GcsEmulator
from cmimem_jax.testing.scripted_llm import ScriptedLLM

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
PYTHON = sys.executable
BUNDLED = os.path.join(REPO, "cmimem_jax", "data", "bundled",
                       "longmemeval_train_sample.json")
DEVICES = 8  # The fake CPU devices the TPU config's mesh (fsdp:-1) spans.
# Step 1 is interrupted, the resumed run trains step 2.
TRAIN_STEPS = 2
KEPT_STEP = 2  # checkpoint.keep_period: the step evaluation selects.
BUCKET = "rehearsal"  # In the emulator; a user names their own.

# Where each stage's command is written, as a user reads it:
# (file, the command's first words).
DOCUMENTED = {
    "serve": ("cmimem_jax/serve.py", "python -m cmimem_jax.serve"),
    "build_expert_states": ("tools/build_expert_states.py",
                            "python -m tools.build_expert_states"),
    "synthesize_qa": ("tools/synthesize_qa.py",
                      "python -m tools.synthesize_qa"),
    "skip_calibration": ("tools/skip_calibration.py",
                         "python -m tools.skip_calibration "
                         "--config=configs/qwen3_4b.py"),
    "train": ("configs/qwen3_4b_tpu.py", "python -m cmimem_jax.train"),
    "evaluate": ("configs/eval_qwen3_4b.py",
                 "python -m cmimem_jax.evaluate"),
    "compare_paper": ("tools/compare_paper.py",
                      "python -m tools.compare_paper"),
}
# Every change to those commands, per stage, by flag: sizes, paths and
# endpoints only ("config.X" flags override config fields). "{work}",
# "{bucket}", "{serve}", "{scripted}" and "{port}" are filled in at run
# time (the workdir, gs://BUCKET, our server's URL and port, the scripted
# endpoint's URL).
CHECKPOINTS = {
    "config.dataset.path": "{work}/data/rl_qa.json",
    "config.encoder.path": "{work}/checkpoints/encoder",
    # The bundled sample's ids are in none of LongMemEval's partitions.
    "config.dataset.split": "all",
}
# The Semantic SKIP calibration table the stand-in encoder's thresholds go
# to (never the packaged one: the stand-in has the real encoder's identity).
SKIP_TABLE = "{work}/skip_calibration.json"
# What train and evaluate read from the bucket (the `bucket` stage copies
# them there).
IN_BUCKET = {
    "config.dataset.path": "{bucket}/data/rl_qa.json",
    "config.encoder.path": "{work}/checkpoints/encoder",
    "config.dataset.split": "all",
}
RECIPE_OVERRIDES: dict[str, dict[str, object]] = {
    "build_expert_states": {
        # From the QA-less records: synthesize_qa asks on these states.
        **CHECKPOINTS, "config.dataset.path": BUNDLED,
        "output": "{work}/expert_states",
        "base_url": "{scripted}", "model": "scripted",
    },
    "synthesize_qa": {
        "input": BUNDLED, "output": "{work}/data/rl_qa.json",
        "expert_states": "{work}/expert_states",
        "base_url": "{scripted}", "model": "scripted",
    },
    "skip_calibration": {
        "config.encoder.path": CHECKPOINTS["config.encoder.path"],
        "output": "{work}/skip_calibration", "table": SKIP_TABLE,
        # One LoCoMo conversation to choose on, one to check on.
        "choose": "0:1", "check": "1:2",
    },
    "train": {
        **IN_BUCKET, "workdir": "{bucket}/train",
        "config.policy.path": "{work}/checkpoints/policy",
        "config.rl.snapshots": "{bucket}/expert_states",
        "config.reward.skip_calibration": SKIP_TABLE,
        "config.qa.answer.base_url": "{serve}",
        "config.qa.answer.model": "cmimem-local",
        "config.qa.judge_endpoint.base_url": "{scripted}",
        "config.qa.answer.max_tokens": 32,
        "config.qa.judge_endpoint.max_tokens": 64,
        "config.rl.sessions_per_batch": 4, "config.rl.max_steps": TRAIN_STEPS,
        "config.rl.micro_batches": 1, "config.rl.logprob_chunk": 128,
        "config.rollout.num_rollouts": 2, "config.rollout.max_new_tokens": 24,
        "config.rollout.max_prompt_tokens": 1280,
        "config.rollout.buckets": (1280,),
        "config.checkpoint.every_steps": 1, "config.checkpoint.keep": 1,
        "config.checkpoint.keep_period": KEPT_STEP,
    },
    "evaluate": {
        **IN_BUCKET, "workdir": "{bucket}/eval",
        "config.dataset.dialogues": 2,
        "config.builder.path": "{work}/checkpoints/policy",
        "config.builder.init_checkpoint": "{bucket}/train",
        "config.builder.checkpoint_step": KEPT_STEP,
        "config.builder.max_new_tokens": 24,
        "config.builder.endpoint.max_tokens": 24,
        "config.answer.endpoint.base_url": "{serve}",
        "config.answer.endpoint.model": "cmimem-local",
        "config.answer.endpoint.max_tokens": 32,
        "config.judge.endpoint.base_url": "{scripted}",
        "config.judge.endpoint.max_tokens": 64,
        "config.memory.chunk_budget_chars": 4000,
    },
    "compare_paper": {"results": "{bucket}/eval"},
}
# Our server as the answer model: the stand-in policy, small shapes. (A
# stand-in for an external LLM, not a config of the recipe.)
SERVE_OVERRIDES = {
    "port": "{port}",
    "config.policy.source": "hf",
    "config.policy.path": "{work}/checkpoints/policy",
    "config.serve.embeddings": False, "config.serve.max_batch": 4,
    "config.serve.max_new_tokens": 32, "config.serve.max_prompt_tokens": 8192,
    "config.serve.buckets": (2048, 8192),
    "config.serve.warm_up_prompt_tokens": (2048,),
}
# Values in a documented command that a user must replace (`gs://...`: the
# bucket).
PLACEHOLDERS = re.compile(r"\.\.\.|\b(DIR|URL|NAME|HOST|DATA)\b|^/(data|ckpt|"
                          r"runs)/")


def continued(lines: list[str], i: int) -> tuple[str, int]:
  """Line `i` of `lines` with the lines its trailing `\\` continues, joined
  by spaces; and how many lines that took."""
  parts = [lines[i]]
  while parts[-1].rstrip().endswith("\\") and i + len(parts) < len(lines):
    parts.append(lines[i + len(parts)])
  return " ".join(p.rstrip().rstrip("\\") for p in parts), len(parts)


def command_words(text: str) -> list[str]:
  """A written command's words: optional `[--flag ...]` / `[,more]` parts
  and a trailing `# comment` dropped (`".[tpu]"` is kept)."""
  return shlex.split(re.sub(r"\[(?:--|,)[^\]]*\]", "", text),
                     comments=True)


def documented_command(path: str, opening: str) -> list[str]:
  """The command that starts with `opening` in file `path` (relative to
  the repository), continuation lines joined and optional `[...]` parts
  dropped, split into words."""
  with open(os.path.join(REPO, path)) as f:
    lines = f.read().splitlines()
  for i, line in enumerate(lines):
    if line.strip().startswith(opening):
      return command_words(continued(lines, i)[0])
  raise ValueError(f"{path} documents no `{opening} ...` command")


def _value(value: object) -> str:
  if isinstance(value, tuple):
    return "(" + ",".join(map(str, value)) + ("," if len(value) == 1 else
                                              "") + ")"
  return str(value)


def apply_overrides(command: list[str], overrides: dict[str, object],
                    fill: dict[str, str], strict: bool = True) -> list[str]:
  """`command` with each `--flag=value` of `overrides` replaced (sizes may
  be added) and `python` this interpreter. A placeholder left unset is an
  error, and so (`strict`) is a path or endpoint the command does not
  name: a user following it could not have set it."""
  named = {w.removeprefix("--").partition("=")[0] for w in command}
  for flag, value in overrides.items():
    if strict and flag not in named and re.search(
        r"\{(work|bucket|serve|scripted)\}", str(value)):
      raise ValueError(f"the documented command has no --{flag}=..., which "
                       "the run needs")
  todo = dict(overrides)
  out = [PYTHON if command[0] == "python" else command[0]]
  for word in command[1:]:
    flag, _, value = word.removeprefix("--").partition("=")
    if word.startswith("--") and flag in todo:
      value = _value(todo.pop(flag))
    elif PLACEHOLDERS.search(value):
      raise ValueError(f"the documented command leaves {word} to the user "
                       "and the rehearsal sets no value for it")
    out.append(f"--{flag}={value.format(**fill)}" if word.startswith("--")
               else word)
  out += [f"--{flag}={_value(v).format(**fill)}" for flag, v in todo.items()]
  return out


@dataclass
class Stage:
  name: str
  seconds: float = 0.0
  ok: bool = False
  result: str = ""


class StageFailed(RuntimeError):
  """A stage's command failed; the message says how."""


def _tail(text: str, lines: int = 6) -> str:
  return " | ".join(text.strip().splitlines()[-lines:])


def _run(command: list[str], log: str, env: dict[str, str],
         timeout_s: float = 600) -> str:
  """Runs `command` (stdout + stderr to `log`); its stdout's last line."""
  with open(log, "w") as out:
    done = subprocess.run(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=out, text=True, timeout=timeout_s)
  with open(log, "a") as out:
    out.write(done.stdout)
  if done.returncode:
    with open(log) as f:
      raise StageFailed(f"exit {done.returncode}: {_tail(f.read())}")
  return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _healthy(url: str) -> bool:
  try:
    with urllib.request.urlopen(url, timeout=2) as response:
      return response.status == 200
  except OSError:
    return False


def _metrics_steps(workdir: str) -> list[int]:
  return [m["step"] for m in read_metrics(workdir)]


def _training_started(log: str) -> bool:
  """Whether `train` printed its "training: steps ..." line."""
  with open(log) as f:
    return any(line.startswith("training: steps") for line in f)


class Rehearsal:
  """The stages over one workdir; `run()` returns the exit status."""

  def __init__(self, workdir: str, echo: Callable[[str], None] = print):
    self.work = os.path.abspath(workdir)
    if os.path.exists(os.path.join(self.work, "logs")):
      raise ValueError(f"{self.work} already holds a rehearsal: use a new "
                       "--workdir")
    self.logs = os.path.join(self.work, "logs")
    os.makedirs(self.logs, exist_ok=True)
    self.echo = echo
    self.stages: list[Stage] = []
    self.fill = {"work": self.work, "bucket": f"gs://{BUCKET}"}
    self.env = dict(os.environ)
    # Compiled programs survive the SIGTERM and the resume.
    self.env.setdefault("JAX_COMPILATION_CACHE_DIR",
                        os.path.join(self.work, "jax_cache"))
    self.env.setdefault("JAX_PLATFORMS", "cpu")
    self.env["XLA_FLAGS"] = (self.env.get("XLA_FLAGS", "") + " --xla_force_"
                             f"host_platform_device_count={DEVICES}").strip()
    self.server: subprocess.Popen | None = None
    self.emulator: GcsEmulator | None = None

  # --- stages ---------------------------------------------------------------

  def standins(self) -> str:
    paths = json.loads(_run(
        [PYTHON, "-m", "cmimem_jax.testing.standins",
         f"--output={self.work}/checkpoints"],
        self._log("standins"), self.env))
    return ("policy and encoder checkpoints in "
            f"{os.path.dirname(paths['policy'])}")

  def serve_start(self) -> str:
    port = _free_port()
    self.fill.update(port=str(port), serve=f"http://127.0.0.1:{port}/v1")
    self.server = subprocess.Popen(
        apply_overrides(documented_command(*DOCUMENTED["serve"]),
                        SERVE_OVERRIDES, self.fill, strict=False),
        cwd=REPO, env=self.env, stdout=open(self._log("serve"), "w"),
        stderr=subprocess.STDOUT, start_new_session=True)
    return f"starting at {self.fill['serve']} (warms up in the background)"

  def synthesize_qa(self) -> str:
    os.makedirs(f"{self.work}/data", exist_ok=True)
    line = _run(self._command("synthesize_qa"), self._log("synthesize_qa"),
                self.env)
    stats = json.loads(line)
    if not stats.get("pairs") or stats.get("failed_sessions"):
      raise StageFailed(f"synthesized {line}")
    return f"{stats['pairs']} QA pairs for {stats['sessions']} sessions"

  def build_expert_states(self) -> str:
    line = _run(self._command("build_expert_states"),
                self._log("build_expert_states"), self.env)
    counts = json.loads(line)
    # (The command itself exits 1 on a failed teacher call.)
    if counts.get("failed") or counts.get("missing") or not counts.get(
        "built"):
      raise StageFailed(f"built {line}")
    return ", ".join(f"{k} {v}" for k, v in counts.items()
                     if k not in ("output",) and not isinstance(v, dict))

  def skip_calibration(self) -> str:
    entry = json.loads(_run(self._command("skip_calibration"),
                            self._log("skip_calibration"), self.env))
    return (f"cosine >= {entry['semantic_skip_cosine']}, coverage >= "
            f"{entry['semantic_skip_coverage']:.3f} in {entry['table']}")

  def bucket(self) -> str:
    """The bucket the TPU commands name, holding the data they read."""
    fs = self.emulator.fs
    self.emulator.bucket(BUCKET)
    fs.put_file(f"{self.work}/data/rl_qa.json", f"{BUCKET}/data/rl_qa.json")
    fs.put(f"{self.work}/expert_states", f"{BUCKET}/expert_states",
           recursive=True)
    return (f"gs://{BUCKET} at {self.emulator.url}: "
            f"{len(self.emulator.objects(BUCKET))} objects")

  def serve_ready(self, timeout_s: float = 300) -> str:
    health = self.fill["serve"].removesuffix("/v1") + "/health"
    deadline = time.monotonic() + timeout_s
    while not _healthy(health):
      if self.server.poll() is not None:
        with open(self._log("serve")) as f:
          raise StageFailed(f"server exited {self.server.returncode}: "
                            f"{_tail(f.read())}")
      if time.monotonic() > deadline:
        raise StageFailed(f"{health} not 200 after {timeout_s:.0f} s")
      time.sleep(1)
    return f"{health} is 200"

  def train(self) -> str:
    workdir = f"gs://{BUCKET}/train"
    command = self._command("train")
    log = self._log("train")
    first = subprocess.Popen(command, cwd=REPO, env=self.env,
                             stdout=open(log, "w"), stderr=subprocess.STDOUT)
    # Into step 1: the loop has started (its first step compiles, samples
    # and updates for tens of seconds); the stop lands inside that step.
    while not _training_started(log):
      if first.poll() is not None:
        with open(log) as f:
          raise StageFailed(f"exit {first.returncode} before training "
                            f"started: {_tail(f.read())}")
      time.sleep(0.5)
    time.sleep(1.0)
    first.send_signal(signal.SIGTERM)
    code = first.wait(timeout=300)
    if code != 128 + signal.SIGTERM:
      raise StageFailed(f"SIGTERM'd train exited {code}, not "
                        f"{128 + signal.SIGTERM}")
    stopped_at = _metrics_steps(workdir)
    if stopped_at != [1]:
      raise StageFailed("SIGTERM during step 1 left metrics steps "
                        f"{stopped_at}, not [1] (the step in progress "
                        "finishes before the stop)")
    _run(command, self._log("train_resumed"), self.env)
    steps = _metrics_steps(workdir)
    if steps != list(range(1, TRAIN_STEPS + 1)):
      raise StageFailed(f"metrics steps {steps} after the resume, not "
                        f"1..{TRAIN_STEPS} once each")
    return (f"SIGTERM after step {stopped_at[-1]} (exit {code}), resumed: "
            f"steps {steps[0]}..{steps[-1]} once each")

  def evaluate(self) -> str:
    workdir = f"gs://{BUCKET}/eval"
    _run(self._command("evaluate"), self._log("evaluate"), self.env)
    results = json.loads(storage.path(f"{workdir}/results.json").read_text())
    n, failures = results.get("n", 0), results.get("failures", -1)
    missing = results.get("missing", -1)  # Questions of unbuilt banks.
    calls = {role: results.get("call_failures", {}).get(role, {}).get(
        "failed_calls", {}) for role in ("answer", "judge")}
    unparseable = calls["judge"].pop("unparseable_verdict", 0)
    if n < 1 or failures or missing or any(calls.values()):
      raise StageFailed(f"n={n}, failures={failures}, missing={missing}, "
                        f"failed calls {calls}")
    return (f"n={n} at step {KEPT_STEP}, 0 failures, 0 failed calls, "
            f"{unparseable} unparseable verdicts")

  def compare_paper(self) -> str:
    _run(self._command("compare_paper"), self._log("compare_paper"),
         self.env)
    return f"tables in {self._log('compare_paper')}"

  # --- driver ---------------------------------------------------------------

  def _log(self, stage: str) -> str:
    return os.path.join(self.logs, f"{stage}.log")

  def _command(self, stage: str) -> list[str]:
    """The stage's documented command with the rehearsal's overrides."""
    return apply_overrides(documented_command(*DOCUMENTED[stage]),
                           RECIPE_OVERRIDES[stage], self.fill)

  def _stage(self, name: str, body: Callable[[], str]) -> bool:
    stage = Stage(name)
    started = time.monotonic()
    try:
      stage.result, stage.ok = body(), True
    except (StageFailed, subprocess.TimeoutExpired, OSError, ValueError,
            KeyError) as e:
      stage.result = f"FAILED: {e}"
    stage.seconds = time.monotonic() - started
    self.stages.append(stage)
    self.echo(f"[{len(self.stages)}] {name:<20} {stage.seconds:6.1f} s  "
              f"{stage.result}")
    return stage.ok

  @contextlib.contextmanager
  def _endpoints(self) -> Iterator[None]:
    with ScriptedLLM() as scripted, GcsEmulator(
        os.path.join(self.work, "gcs")) as emulator:
      self.fill["scripted"] = scripted.base_url
      self.emulator = emulator
      self.env = emulator.child_environment(self.env)
      try:
        yield
      finally:
        if self.server is not None and self.server.poll() is None:
          os.killpg(self.server.pid, signal.SIGINT)
          try:
            self.server.wait(timeout=30)
          except subprocess.TimeoutExpired:
            os.killpg(self.server.pid, signal.SIGKILL)

  # The stages in the recipe's order (README), each run by the method of
  # its name ("serve": `serve_start`).
  STAGES = ("standins", "serve", "build_expert_states", "synthesize_qa",
            "skip_calibration", "bucket", "serve_ready", "train", "evaluate",
            "compare_paper")

  def run(self) -> int:
    plan = [(name, getattr(self, "serve_start" if name == "serve" else name))
            for name in self.STAGES]
    started = time.monotonic()
    with self._endpoints():
      for name, body in plan:
        if not self._stage(name, body):
          break
    total = time.monotonic() - started
    self.echo("\n| stage | seconds | result |\n|---|---:|---|")
    for stage in self.stages:
      self.echo(f"| {stage.name} | {stage.seconds:.1f} | {stage.result} |")
    self.echo(f"| total | {total:.1f} | |")
    failed = [s.name for s in self.stages if not s.ok]
    if failed:
      self.echo(f"rehearsal failed at stage {failed[0]} (logs: {self.logs})")
      return 1
    self.echo(f"rehearsal passed: {len(self.stages)} stages in {total:.0f} s")
    return 0


# This tool's flags (its own: tools share flag names).
FLAGS = flags.FlagValues()
flags.DEFINE_string("workdir", None, "The rehearsal's directory (new).",
                    flag_values=FLAGS, required=True)


def main(argv: list[str]) -> int:
  del argv
  try:
    rehearsal = Rehearsal(FLAGS.workdir)
  except ValueError as e:
    sys.exit(f"error: {e}")
  return rehearsal.run()


if __name__ == "__main__":
  run_command(main, flag_values=FLAGS, compilation_cache=False)
