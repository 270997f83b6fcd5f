"""Fixed expert states (`rl.snapshots` = a directory): built by a teacher
with `tools/build_expert_states.py`, resumable, rejected answers counted;
the trainer's prompts and rewards use them and nothing rebuilds them."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

from cmimem_jax.client import CallResult
from cmimem_jax.config import CallsFailed, check_failures
from cmimem_jax.memory import MemoryBank
from cmimem_jax.rl import read_metrics
from cmimem_jax.sampling import EngineHooks
from cmimem_jax.sampling.sampler import SampleOutput, bucket_length, left_pad
from cmimem_jax.task.curriculum import SessionRef
from cmimem_jax.task.loop import Trainer
from cmimem_jax.task.reward import NO_EXPERT_RESPONSE
from cmimem_jax.task.snapshots import (TEACHER_LOG, expert_responses,
                                       teacher_records)
from cmimem_jax.testing.scripted_llm import ScriptedLLM
from tools import build_expert_states

from test_train import TINY_BUCKETS, tiny_config  # noqa: I100

ROOT = pathlib.Path(__file__).resolve().parents[2]

MARKER = "Expert marker: the user drinks green tea"


class ScriptedTeacher:
  """A DSL teacher: one episodic fact per session (its first turn), the
  marker in semantic memory; the prompt of a session holding `reject`
  gets an invalid answer. `fail_after` calls raise (a crash)."""

  def __init__(self, reject="", fail_after=None):
    self.reject, self.fail_after, self.calls = reject, fail_after, 0

  def chat_many(self, conversations, max_tokens=None):
    del max_tokens
    out = []
    for messages in conversations:
      if self.fail_after is not None and self.calls >= self.fail_after:
        raise RuntimeError("teacher went away")
      self.calls += 1
      prompt = messages[-1]["content"]
      first = prompt.split("New session:")[-1].strip().splitlines()
      fact = next((l for l in first if ":" in l), "a session")[:80]
      if self.reject and self.reject in prompt:
        out.append(CallResult("I will not answer in the format."))
        continue
      out.append(CallResult(
          f"CORE:APPEND|Talks about {fact.replace('|', ' ')}\n"
          f"EPISODIC:ADD|{fact.replace('|', ' ')}\n"
          f"SEMANTIC:ADD|{MARKER}\nPROCEDURAL:SKIP"))
    return out


def _build(directory, teacher, **overrides):
  return build_expert_states.build(tiny_config(**overrides), str(directory),
                                   teacher, "scripted", "dsl")


def _banks(directory):
  return {str(p.relative_to(directory)): MemoryBank.load(str(p))
          for p in sorted(pathlib.Path(directory).glob("*/s*"))}


def test_states_are_resumable_and_count_rejections(tmp_path):
  whole = _build(tmp_path / "whole", ScriptedTeacher(reject="Biscuit climbed"))
  sessions, dialogues = whole["sessions"], whole["dialogues"]
  assert whole["built"] == sessions - dialogues  # The last session's state
  assert whole["rejected"] == 1                  # is never needed.
  # A crash after 5 teacher answers, then a rerun: same states, nothing
  # asked twice but the session in flight.
  with pytest.raises(RuntimeError, match="went away"):
    _build(tmp_path / "resumed", ScriptedTeacher("Biscuit climbed", 5))
  rerun = _build(tmp_path / "resumed", ScriptedTeacher("Biscuit climbed"))
  assert rerun["built"] == sessions - dialogues - 5
  assert rerun["rejected"] == 1
  assert _banks(tmp_path / "whole") == _banks(tmp_path / "resumed")
  records = teacher_records(str(tmp_path / "resumed"))
  assert len(records) == sessions - dialogues
  assert sum(not r["valid"] for r in records.values()) == 1
  assert os.path.exists(tmp_path / "resumed" / TEACHER_LOG)
  # The length penalty's reference: the valid teacher responses, parsed.
  experts = expert_responses(str(tmp_path / "resumed"))
  assert set(experts) == {k for k, r in records.items() if r["valid"]}
  assert all(MARKER in e.text and e.valid for e in experts.values())
  # Other settings (another encoder) are refused, not mixed in.
  with pytest.raises(ValueError, match="other settings"):
    _build(tmp_path / "whole", ScriptedTeacher(), **{"encoder.dim": 32})


class FailingTeacher(ScriptedTeacher):
  """The scripted teacher whose calls fail (no response at all: a dead
  endpoint) for the sessions whose prompt holds `fail` ("" = every one)."""

  def __init__(self, fail=""):
    super().__init__()
    self.fail = fail

  def chat_many(self, conversations, max_tokens=None):
    answers = super().chat_many(conversations, max_tokens)
    return [CallResult(None, "connection: APIConnectionError: refused")
            if self.fail in m[-1]["content"] else a
            for m, a in zip(conversations, answers)]


def _saved_states(directory):
  return sorted(str(p.relative_to(directory))
                for p in pathlib.Path(directory).glob("*/s*"))


def test_a_failed_teacher_call_saves_no_state_and_a_rerun_builds_it(
    tmp_path):
  """A dead teacher: every dialogue stops at its first call, no state but
  the empty s0 is saved, the failure gate names the endpoint; the rerun
  with a working teacher builds every state, as one uninterrupted run."""
  whole = _build(tmp_path / "whole", ScriptedTeacher())
  dead = _build(tmp_path / "states", FailingTeacher())
  dialogues, sessions = dead["dialogues"], dead["sessions"]
  assert dead["built"] == 0 and dead["failed"] == dialogues
  assert dead["missing"] == sessions - dialogues and dead["rejected"] == 0
  assert _saved_states(tmp_path / "states") == sorted(
      f"{d}/s0" for d in {p.split("/")[0] for p in
                          _saved_states(tmp_path / "whole")})
  assert not teacher_records(str(tmp_path / "states"))
  with pytest.raises(CallsFailed, match=(
      f"^all {dialogues} sessions' teacher calls to http://dead failed; "
      f"{sessions - dialogues} states not built$")):
    check_failures(dead["failed"], dead["built"] + dead["failed"], 0.0,
                   "sessions' teacher calls to http://dead",
                   f"{dead['missing']} states not built")
  rerun = _build(tmp_path / "states", ScriptedTeacher())
  assert rerun["built"] == whole["built"] and rerun["missing"] == 0
  assert _banks(tmp_path / "states") == _banks(tmp_path / "whole")
  # One session failing: its dialogue stops there, the others finish; the
  # gate accepts it only at a rate that covers it.
  partial = _build(tmp_path / "partial", FailingTeacher("Biscuit climbed"))
  assert partial["failed"] == 1 and partial["missing"] > 0
  total = partial["built"] + partial["failed"]
  with pytest.raises(CallsFailed, match=f"^1 of {total} calls failed \\(more "
                     "than --max_failure_rate=0.05\\)"):
    check_failures(1, total, 0.05, "calls")
  check_failures(1, total, 1 / total, "calls")  # Accepted: no error.


def test_states_built_past_a_failed_call_by_an_older_version_are_rebuilt(
    tmp_path):
  """An earlier version logged a failed call as a rejected response and
  saved the unchanged bank as the next state: a rerun finds those states
  by their teacher records and builds them again."""
  whole = _build(tmp_path / "whole", ScriptedTeacher())
  directory = tmp_path / "old"
  _build(directory, ScriptedTeacher())
  log = directory / TEACHER_LOG
  records = [json.loads(line) for line in log.read_text().splitlines()]
  stale = records[1]  # Session 1 of the first dialogue: "failed".
  stale.update(valid=False, response="",
               errors=["line None: policy call failed: connection: refused"])
  log.write_text("".join(json.dumps(r) + "\n" for r in records))
  dialogue, t = stale["dialogue_id"], stale["session_index"]
  old_bank = MemoryBank.load(str(directory / dialogue / f"s{t}"))
  old_bank.save(str(directory / dialogue / f"s{t + 1}"))
  rerun = _build(directory, ScriptedTeacher())
  later = sum(1 for r in records if r["dialogue_id"] == dialogue
              and r["session_index"] >= t)
  assert rerun["built"] == later and rerun["rejected"] == 0
  assert _banks(directory) == _banks(tmp_path / "whole")
  assert whole["missing"] == 0


@pytest.mark.slow
def test_the_command_exits_non_zero_on_a_dead_teacher_and_resumes(tmp_path):
  """`python -m tools.build_expert_states` itself: nothing listening at the
  teacher's URL -> one error line naming it, exit 1, no state; the same
  command against the scripted stand-in builds every state."""
  with socket.socket() as probe:  # A port where nothing listens.
    probe.bind(("127.0.0.1", 0))
    dead = f"http://127.0.0.1:{probe.getsockname()[1]}/v1"
  command = [sys.executable, "-m", "tools.build_expert_states",
             f"--config={ROOT / 'configs' / 'tiny.py'}",
             "--config.dataset.dialogues=2", f"--output={tmp_path / 's'}",
             "--model=scripted", "--format=dsl", "--max_retries=0"]
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
  failed = subprocess.run(command + [f"--base_url={dead}"], env=env,
                          capture_output=True, text=True, timeout=300)
  assert failed.returncode == 1, failed.stderr
  error = failed.stderr.strip().splitlines()[-1]
  assert error.startswith("error: CallsFailed: all 2 sessions' teacher calls "
                          f"to {dead}"), failed.stderr
  assert "Traceback" not in failed.stderr
  assert json.loads(failed.stdout)["built"] == 0
  assert all(p.endswith("/s0") for p in _saved_states(tmp_path / "s"))
  with ScriptedLLM() as teacher:
    done = subprocess.run(command + [f"--base_url={teacher.base_url}"],
                          env=env, capture_output=True, text=True,
                          timeout=300)
  assert done.returncode == 0, done.stderr
  counts = json.loads(done.stdout)
  assert counts["failed"] == 0 and counts["missing"] == 0
  assert counts["built"] == counts["sessions"] - counts["dialogues"]


class CopyingEngine(EngineHooks):
  """Every rollout writes the marker again: a cross-duplicate exactly when
  M_{t-1} (the expert state) holds it."""

  def __init__(self, tokenizer):
    self.ids = tokenizer.encode(
        f"CORE:APPEND|Likes tea\nEPISODIC:SKIP\nSEMANTIC:ADD|{MARKER}\n"
        "PROCEDURAL:SKIP", add_special_tokens=False)
    self.prompts = []  # Every prompt row asked for, in order.

  def set_model(self, model):
    del model

  def generate(self, prompts, key, temperature, top_p, max_new_tokens,
               row_budgets=None, constrained=True):
    self.prompts += [list(p) for p in prompts]
    tokens = np.tile(np.asarray(self.ids, np.int32), (len(prompts), 1))
    del key, temperature, top_p, max_new_tokens, row_budgets, constrained
    prompt, mask = left_pad(prompts, bucket_length(
        max(len(p) for p in prompts), TINY_BUCKETS), 0)
    return SampleOutput(tokens, np.full(tokens.shape, -1.0, np.float32),
                        np.full(len(prompts), len(self.ids)), prompt, mask)


@pytest.mark.slow
def test_the_trainer_uses_the_expert_states_and_never_rebuilds_them(
    tmp_path):
  states = tmp_path / "states"
  _build(states, ScriptedTeacher())
  # 3 steps per epoch: step 4 crosses an epoch boundary, where policy-built
  # snapshots would be refreshed.
  loop = Trainer(tiny_config(**{"rl.snapshots": str(states),
                                "rl.max_steps": 4,
                                "rl.sessions_per_batch": 5}),
                 str(tmp_path / "run"))
  loop.policy.engine = CopyingEngine(loop.policy.tokenizer)
  expert = _banks(states)
  responses = expert_responses(str(states))
  for ref in loop.curriculum.batch(0):
    dialogue = loop.dialogues[ref.dialogue]
    bank = loop.episode(ref).bank
    assert bank == expert[f"{dialogue.dialogue_id}/s{ref.session}"]
    # The teacher's response is the reward's length reference; a dialogue's
    # last session has none (never built): MemBuilder's formula without
    # `expert_output`, not the absolute band.
    assert loop.episode(ref).expert == responses.get(
        (dialogue.dialogue_id, ref.session), NO_EXPERT_RESPONSE)
    if ref.session > 0:  # The policy prompt shows the expert's memories.
      prompt = loop.policy.tokenizer.decode(loop.policy.encode(
          loop.prompter(bank, loop.episode(ref).session)))
      assert MARKER in prompt
  last = SessionRef(0, len(loop.dialogues[0].sessions) - 1, 0.0)
  assert loop.episode(last).expert is NO_EXPERT_RESPONSE
  snapshots = loop.snapshots
  loop.run()
  # The first step's rollouts were asked on those prompts (`loop.prompter`,
  # the one policy prompt), one row per rollout.
  group = loop.config.rollout.num_rollouts
  first = [loop.policy.encode(loop.prompter(e.bank, e.session))
           for e in map(loop.episode, loop.curriculum.batch(0))
           for _ in range(group)]
  assert loop.policy.engine.prompts[:len(first)] == first
  assert loop.snapshots is snapshots  # Nothing rebuilt at the epoch.
  assert not (tmp_path / "run" / "snapshots").exists()
  metrics = read_metrics(str(tmp_path / "run"))
  assert [m["epoch"] for m in metrics] == [0, 0, 0, 1]
  assert {m["snapshot_version"] for m in metrics} == {0}
  # Rewards are computed on the expert states: the copied marker is a
  # cross-duplicate in every session after the first.
  duplicates = [m["reward/cross_duplicate_fraction"] for m in metrics]
  assert all(d > 0 for d in duplicates), duplicates
  assert json.loads((states / "states.json").read_text())["teacher"] == {
      "model": "scripted", "format": "dsl"}
