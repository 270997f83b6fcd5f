"""tools/rehearse.py: the paper's recipe end to end through its documented
commands and configs, changed only in sizes, paths and endpoints."""

import json
import os
import subprocess
import sys

import pytest

from cmimem_jax.memory import parse
from cmimem_jax.memory.prompts import render_template
from cmimem_jax.testing import scripted_llm
from tools import rehearse

# What a rehearsal may change. Sizes: counts, token lengths and buckets,
# dataset slices, checkpoint periods. Paths: inputs, outputs, checkpoints.
# Endpoints: where a model is served and its name there.
SIZES = {
    "config.rl.sessions_per_batch", "config.rl.max_steps",
    "config.rl.micro_batches", "config.rl.logprob_chunk",
    "config.rollout.num_rollouts", "config.rollout.max_new_tokens",
    "config.rollout.max_prompt_tokens", "config.rollout.buckets",
    "config.checkpoint.every_steps", "config.checkpoint.keep",
    "config.checkpoint.keep_period", "config.dataset.split",
    "config.dataset.dialogues", "config.builder.max_new_tokens",
    "config.builder.endpoint.max_tokens", "config.answer.endpoint.max_tokens",
    "config.judge.endpoint.max_tokens", "config.qa.answer.max_tokens",
    "config.qa.judge_endpoint.max_tokens", "config.memory.chunk_budget_chars",
    "config.builder.checkpoint_step", "choose", "check",
}
PATHS = {
    "config.dataset.path", "config.encoder.path", "config.policy.path",
    "config.rl.snapshots", "config.builder.path",
    "config.builder.init_checkpoint", "workdir", "output", "input",
    "results", "expert_states", "table", "config.reward.skip_calibration",
}
ENDPOINTS = {
    "config.qa.answer.base_url", "config.qa.answer.model",
    "config.qa.judge_endpoint.base_url", "config.answer.endpoint.base_url",
    "config.answer.endpoint.model", "config.judge.endpoint.base_url",
    "base_url", "model",
}


def test_the_rehearsal_overrides_only_sizes_paths_and_endpoints():
  assert set(rehearse.RECIPE_OVERRIDES) <= set(rehearse.DOCUMENTED)
  for stage, overrides in rehearse.RECIPE_OVERRIDES.items():
    for flag in overrides:
      assert flag in SIZES | PATHS | ENDPOINTS, (stage, flag)


def test_every_stage_runs_its_documented_command():
  fill = {"work": "/w", "bucket": "gs://b", "serve": "http://s/v1",
          "scripted": "http://x/v1", "port": "1"}
  for stage, (path, opening) in rehearse.DOCUMENTED.items():
    command = rehearse.documented_command(path, opening)
    assert " ".join(command).startswith(opening), stage
    overrides = rehearse.RECIPE_OVERRIDES.get(stage,
                                              rehearse.SERVE_OVERRIDES)
    built = rehearse.apply_overrides(command, overrides, fill,
                                     strict=stage != "serve")
    assert built[0] == sys.executable
    assert not any("..." in word or "/ckpt/" in word for word in built), built


def test_the_rehearsal_runs_the_recipe_in_readmes_order():
  """README's recipe block: build_expert_states, synthesize_qa on its
  states, skip_calibration, train; the rehearsal's stages in that order."""
  with open(os.path.join(rehearse.REPO, "README.md")) as f:
    readme = f.read()
  block = readme[readme.index("python -m tools.build_expert_states"):]
  block = block[:block.index("```")]
  order = [stage for stage in ("build_expert_states", "synthesize_qa",
                               "skip_calibration", "train")
           if stage in rehearse.DOCUMENTED]
  positions = [block.index(rehearse.DOCUMENTED[stage][1].split(" --")[0])
               for stage in order]
  assert positions == sorted(positions) and len(order) == 4
  stages = rehearse.Rehearsal.STAGES
  assert [s for s in stages if s in order] == order
  assert "--expert_states=/data/expert_states" in block


def test_a_documented_command_missing_a_path_fails_the_rehearsal():
  """The 4B configs' example commands once left out
  `--config.rl.snapshots`: the rehearsal must not add it silently."""
  command = [w for w in rehearse.documented_command(
      *rehearse.DOCUMENTED["train"]) if "rl.snapshots" not in w]
  with pytest.raises(ValueError, match="no --config.rl.snapshots"):
    rehearse.apply_overrides(command, rehearse.RECIPE_OVERRIDES["train"],
                             {"work": "/w", "serve": "s", "scripted": "x"})
  with pytest.raises(ValueError, match="leaves --workdir=DIR to the user"):
    rehearse.apply_overrides(["python", "--workdir=DIR"], {}, {})


def test_the_scripted_llm_answers_each_documented_prompt_in_its_format():
  session = "user: I adopted a greyhound named Biscuit. She is shy.\n" \
            "assistant: Lovely!"
  messages = [{"role": "system", "content": render_template("policy_system")},
              {"role": "user", "content": render_template(
                  "policy_user", core_memory="(none)",
                  episodic_memories="(none)", semantic_memories="(none)",
                  procedural_memories="(none)", session_index=1,
                  session_date="2024-03-02", session_text=session)}]
  response = parse(scripted_llm.reply(messages))
  assert response.valid, response.errors
  verdict = scripted_llm.reply([{"role": "user", "content": render_template(
      "judge", question="q", gold_answer="Biscuit",
      generated_answer="A dog named Biscuit.")}])
  assert verdict.endswith('{"label": "CORRECT"}')
  core = json.loads(scripted_llm.reply([{"role": "user", "content":
                                         render_template(
      "core_agent", core_memory="", core_usage=0, messages=session,
      core_cap=5000)}]))
  assert core == {"operation": "APPEND",
                  "content": "I adopted a greyhound named Biscuit."}
  assert scripted_llm.reply([{"role": "user", "content": "Hello?"}]) is None


@pytest.mark.slow
def test_the_recipe_rehearses_end_to_end(tmp_path):
  work = tmp_path / "rehearsal"
  result = subprocess.run([sys.executable, "-m", "tools.rehearse",
                           f"--workdir={work}"], cwd=rehearse.REPO,
                          capture_output=True, text=True, timeout=900)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  assert "rehearsal passed" in result.stdout
  assert (work / "expert_states" / "states.json").exists()
  # Train and evaluate ran on the emulator's bucket (its filesystem backend
  # keeps each object as a file under its name); nothing of theirs is
  # local.
  bucket = work / "gcs" / "objects" / rehearse.BUCKET
  assert not (work / "train").exists() and not (work / "eval").exists()
  with open(bucket / "train" / "metrics.jsonl") as f:
    steps = [json.loads(line)["step"] for line in f if '"step"' in line]
  assert steps == list(range(1, rehearse.TRAIN_STEPS + 1))
  assert (bucket / "train" / "checkpoints" / str(rehearse.KEPT_STEP)
          / "commit_success.txt").exists()
  with open(bucket / "eval" / "results.json") as f:
    results = json.load(f)
  assert results["n"] >= 1 and results["failures"] == 0
