"""Teacher trajectories, the SFT job, and GRPO started from its checkpoint
with grammar-constrained rollouts."""

import json
import os
import re

import jax
import numpy as np
import pytest

from cmimem_jax.config import apply_overrides
from cmimem_jax.data import bundled_path
from cmimem_jax.encoders import HashingEncoder
from cmimem_jax.memory import MemoryBank, apply_response
from cmimem_jax.memory.dsl import parse, response_regex
from cmimem_jax.rl import Checkpointer, read_metrics
from cmimem_jax.sampling import encode_chat, load_tokenizer
from cmimem_jax.sampling import sampler as sampler_module
from cmimem_jax.task.loop import Trainer
from cmimem_jax.task import warm_start
from cmimem_jax.task.warm_start import run_sft, summary_line, write_jsonl
from cmimem_jax.testing import run_tool
from cmimem_jax.testing.fake_openai import FakeOpenAI
from configs import default, small_repro, tiny
from tools import make_sft_data


def test_annotation_trajectories_are_valid_and_apply(tmp_path, locomo_path):
  output = tmp_path / "sft.jsonl"
  summary = run_tool(make_sft_data, [
      f"--input={locomo_path}", "--dialogues=0:1", f"--output={output}",
      "--encoder=hashing", "--dim=32"])
  records = [json.loads(line) for line in output.read_text().splitlines()]
  assert summary["records"] == len(records) == 19  # conv-26's sessions.
  assert summary["rejected"] == 0 and summary["dialogue_ids"] == ["conv-26"]
  grammar = re.compile(response_regex())
  bank = MemoryBank("conv-26", 32)
  for record in records:
    assert grammar.fullmatch(record["response"]), record["response"][:200]
    assert record["messages"][0]["role"] == "system"
    bank, report = apply_response(bank, parse(record["response"]),
                                  HashingEncoder(dim=32),
                                  session_index=record["session_index"])
    assert report.applied and not report.errors
  assert len(bank) > 50  # Every session's events and observations landed.
  # Under a token budget, late sessions show fewer retrieved entries.
  budget = 1200
  summary = run_tool(make_sft_data, [
      f"--input={locomo_path}", "--dialogues=0:1", f"--output={output}",
      "--encoder=hashing", "--dim=32", f"--max_prompt_tokens={budget}"])
  fitted = [json.loads(line) for line in output.read_text().splitlines()]
  assert [r["response"] for r in fitted] == [r["response"] for r in records]
  tokenizer = load_tokenizer("")
  lengths = [len(encode_chat(tokenizer, r["messages"])) for r in fitted]
  shown = [r["retrieved_per_type"] for r in fitted]
  assert summary["trimmed"] == sum(k < 20 for k in shown) > 0
  assert all(n <= budget or k == 0 for n, k in zip(lengths, shown))


def test_extractive_trajectories_fit_the_rollout_budget(tmp_path):
  """`make demo`'s teacher: every bundled session, each response within
  the 80-token rollout (EOS included) and in the grammar's form."""
  output = tmp_path / "sft.jsonl"
  common = ["--dataset=longmemeval", f"--input={bundled_path()}",
            f"--output={output}", "--encoder=hashing", "--dim=32"]
  summary = run_tool(make_sft_data, ["--teacher=extractive",
                                     "--max_response_tokens=80", *common])
  records = [json.loads(line) for line in output.read_text().splitlines()]
  assert summary["records"] == len(records) == 15  # The sample's sessions.
  assert summary["rejected"] == 0 and {r["source"] for r in records} == {
      "extractive"}
  tokenizer = load_tokenizer("")
  grammar = re.compile(response_regex())
  for record in records:
    assert grammar.fullmatch(record["response"]), record["response"]
    assert len(tokenizer.encode(record["response"],
                                add_special_tokens=False)) + 1 <= 80
  # `make demo`'s warm start trains on every one of them.
  demo = default.get_config()
  assert demo.sft.max_response_tokens == demo.rollout.max_new_tokens == 80
  examples, too_long = warm_start._examples(
      str(output), tokenizer, demo.sft.max_prompt_tokens,
      demo.sft.max_response_tokens)
  assert too_long == 0 and len(examples) == 15
  unbounded = run_tool(make_sft_data, ["--teacher=extractive", *common])
  longer = [json.loads(line) for line in output.read_text().splitlines()]
  assert unbounded["records"] == 15 and sum(
      len(b["response"]) > len(a["response"])
      for a, b in zip(records, longer)) > 0
  for wrong in (["--teacher=extractive", "--base_url=http://x/v1"],
                ["--max_response_tokens=80"]):
    with pytest.raises(SystemExit):
      run_tool(make_sft_data, [*wrong, *common])


def tiny_config(tmp_path, **overrides):
  config = tiny.get_config()
  config.mesh = "data:2,tensor:4"  # The 8 fake CPU devices of conftest.
  config.tensorboard = False
  config.sft = small_repro.get_config().sft
  data = tmp_path / "teacher.jsonl"
  write_jsonl(str(data), [
      {"messages": [{"role": "user", "content": f"Session {i}: I like tea."}],
       "response": "CORE:APPEND|Likes tea\nEPISODIC:SKIP\nSEMANTIC:ADD|"
                   f"Tea - drink {i}\nPROCEDURAL:SKIP\n"} for i in range(8)])
  config.sft.update({"data": str(data), "max_steps": 3, "batch_size": 8,
                     "max_prompt_tokens": 64, "max_response_tokens": 48,
                     "buckets": (64,), "learning_rate": 1e-3})
  return apply_overrides(config, overrides)


@pytest.mark.slow
def test_sft_then_constrained_grpo_from_its_checkpoint(tmp_path):
  sft_dir = str(tmp_path / "sft")
  lines = []
  history = run_sft(tiny_config(tmp_path), sft_dir, echo=lines.append)
  assert [m["step"] for m in read_metrics(sft_dir)] == [1, 2, 3]
  assert [line.split(":")[0] for line in lines] == [
      f"warm start step {s}/3" for s in (1, 2, 3)]
  assert summary_line(read_metrics(sft_dir), sft_dir).endswith(
      f"(step 3); GRPO from it: --config.policy.init_checkpoint={sft_dir}")
  assert history[-1]["nll"] < history[0]["nll"]
  resumed = run_sft(tiny_config(tmp_path, **{"sft.max_steps": 4}), sft_dir)
  assert len(resumed) == 1  # Steps 1-3 come from the checkpoint.
  with open(os.path.join(sft_dir, "config.json")) as f:
    assert json.load(f)["sft"]["max_steps"] == 4  # The resumed run's.

  # Two of the sample's dialogues (3 sessions each): the policy builds its
  # snapshots in one batch shape (all six dialogues: two shapes).
  config = tiny_config(tmp_path, **{
      "policy.init_checkpoint": sft_dir, "rollout.constrained_dsl": True,
      "rollout.max_new_tokens": 40, "rl.max_steps": 1, "policy.seed": 5,
      "dataset.dialogues": 2, "rollout.release_programs_each_step": True})
  loop = Trainer(config, str(tmp_path / "rl"))
  with open(tmp_path / "rl" / "config.json") as f:
    saved_config = json.load(f)
  assert saved_config["policy"]["init_checkpoint"] == sft_dir
  assert saved_config["rl"]["max_steps"] == 1
  _, saved = Checkpointer(os.path.join(sft_dir, "checkpoints")
                          ).restore_params(loop.learner.params)
  for ours, want in zip(jax.tree.leaves(jax.device_get(loop.learner.params)),
                        jax.tree.leaves(jax.device_get(saved))):
    np.testing.assert_array_equal(ours, want)
  # The KL reference is the warm start too.
  for ref, want in zip(jax.tree.leaves(jax.device_get(loop.learner.ref_params)),
                       jax.tree.leaves(jax.device_get(saved))):
    np.testing.assert_array_equal(ref, want)
  # Over the mesh only the table the learner reads: the sampler decodes on
  # one device with its own (each [S, V] table is 40 MB per device here).
  over_mesh = [name for name, _, sharding in loop.constraint._placed
               if len(sharding.device_set) == 8]
  assert over_mesh == ["min_budget"]
  # rollout.release_programs_each_step: the update runs with no decoding
  # program resident (the next rollout loads them back).
  programs_at_update = []
  learner_step = loop.learner.step
  loop.learner.step = lambda batch: (
      programs_at_update.append(
          sampler_module._generate.jitted_fn._cache_size()),
      learner_step(batch))[1]
  metrics = loop.step()
  assert programs_at_update == [0]
  assert metrics["validity_rate"] == 1.0
  assert metrics["logprob_gap"] < 1e-5  # Sampler and learner masks agree.
  assert metrics["response_tokens_mean"] <= 40


def test_teacher_endpoint_keeps_valid_answers_and_counts_the_rest(
    tmp_path, locomo_path):
  calls = []

  def teacher(content):
    calls.append(content)
    if len(calls) % 3 == 0:
      return "Sure! Here are the memory operations you asked for."
    # Unordered, with a blank line: kept, and rewritten canonically.
    return (f"SEMANTIC:ADD|Fact {len(calls)}\nCORE:APPEND|Note\n\n"
            "PROCEDURAL:SKIP\nEPISODIC:SKIP")

  output = tmp_path / "teacher.jsonl"
  with FakeOpenAI(reply=teacher) as server:
    summary = run_tool(make_sft_data, [
        f"--input={locomo_path}", "--dialogues=0:1", f"--output={output}",
        "--encoder=hashing", "--dim=32", f"--base_url={server.base_url}",
        "--model=teacher-x"])
  records = [json.loads(line) for line in output.read_text().splitlines()]
  assert len(calls) == 19
  assert summary["rejected"] == 6 and len(records) == 13
  assert records[0]["source"] == "teacher:teacher-x"
  assert records[0]["response"] == ("CORE:APPEND|Note\nEPISODIC:SKIP\n"
                                    "SEMANTIC:ADD|Fact 1\nPROCEDURAL:SKIP\n")
  grammar = re.compile(response_regex())
  assert all(grammar.fullmatch(r["response"]) for r in records)
