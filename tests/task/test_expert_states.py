"""Fixed expert states (`rl.snapshots` = a directory): built by a teacher
with `tools/build_expert_states.py`, resumable, rejected answers counted;
the trainer's prompts and rewards use them and nothing rebuilds them."""

import json
import os
import pathlib
import sys

import numpy as np
import pytest

from cmimem_jax.client import CallResult
from cmimem_jax.memory import MemoryBank
from cmimem_jax.rl import read_metrics
from cmimem_jax.sampling import EngineHooks
from cmimem_jax.sampling.sampler import SampleOutput, bucket_length, left_pad
from cmimem_jax.task.episode import policy_messages
from cmimem_jax.task.loop import Trainer
from cmimem_jax.task.snapshots import (TEACHER_LOG, expert_responses,
                                       teacher_records)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tools"))
import build_expert_states  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from test_train import TINY_BUCKETS, tiny_config  # noqa: E402

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


class CopyingEngine(EngineHooks):
  """Every rollout writes the marker again: a cross-duplicate exactly when
  M_{t-1} (the expert state) holds it."""

  def __init__(self, tokenizer):
    self.ids = tokenizer.encode(
        f"CORE:APPEND|Likes tea\nEPISODIC:SKIP\nSEMANTIC:ADD|{MARKER}\n"
        "PROCEDURAL:SKIP", add_special_tokens=False)

  def set_model(self, model):
    del model

  def generate(self, prompts, key, temperature, top_p, max_new_tokens,
               row_budgets=None, constrained=True):
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
  for ref in loop.curriculum.batch(0):
    dialogue = loop.dialogues[ref.dialogue]
    bank = loop.episode(ref).bank
    assert bank == expert[f"{dialogue.dialogue_id}/s{ref.session}"]
    # The teacher's response is the reward's length reference.
    assert loop.episode(ref).expert == expert_responses(str(states)).get(
        (dialogue.dialogue_id, ref.session))
    if ref.session > 0:  # The policy prompt shows the expert's memories.
      prompt = loop.policy.tokenizer.decode(loop.policy.encode(
          policy_messages(bank, loop.episode(ref).session, loop.encoder,
                          loop.config.rollout.retrieval_top_k)))
      assert MARKER in prompt
  snapshots = loop.snapshots
  loop.run()
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
