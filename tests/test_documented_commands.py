"""Every command README.md, the guides under docs/ and the configs'
docstrings tell a user to type is run, as written, by a test or by the
rehearsal (`tools/rehearse.py`), with only sizes, paths and endpoints
changed; one that cannot run cheaply says why and what covers it (issue
44). README's quick start has its own test (its commands are documented
ones), and its development block names the suite's own make targets.

`COMMANDS` is the registry. A command is keyed by its words with the
values of size, path and endpoint flags blanked (`--workdir=*`), so the
same command written in two places (README and a docstring) shares one
entry exactly when it differs only in those values. Prose mentions such
as "`python -m cmimem_jax.sft` with this file" are not commands (they name
no `--config=`)."""

from __future__ import annotations

import ast
import glob
import json
import os
import re
from dataclasses import dataclass

import pytest

from cmimem_jax.config import validate_config
from cmimem_jax.data import DatasetConfig
from cmimem_jax.encoders import EncoderConfig
from cmimem_jax.evaluation.run import EVALUATION_SECTIONS
from cmimem_jax.memory.builder import MemoryConfig
from cmimem_jax.task.loop import TRAINING_SECTIONS
from cmimem_jax.task.reward import RewardConfig
from cmimem_jax.task.warm_start import SFT_SECTIONS
from cmimem_jax.testing import run_tool, scripted_llm
from cmimem_jax.testing.fake_openai import FakeOpenAI
from tools import make_sft_data, rehearse

REPO = rehearse.REPO
# The documents whose ```bash blocks are read, every section but these
# (README's): the quick start is checked below against the others; the
# development block runs the suite itself (`make test`, the bench).
DOCUMENTS = ("README.md", "docs/*.md")
UNREAD_SECTIONS = ("## Quick start", "## Development")
OPENINGS = ("python ", "make ", "pip ")
# A flag's last dotted part decides what it is. Sizes: counts, token
# lengths, slices, shapes; paths: inputs, outputs, checkpoints; endpoints:
# where a model is served and its name there.
SIZES = {"dialogues", "limit", "max_steps", "batch", "layers", "length",
         "completion", "budgets", "max_prompt_tokens", "max_response_tokens",
         "per_session", "conversations", "per_class", "sessions_per_batch",
         "num_rollouts", "max_new_tokens", "max_tokens", "checkpoint_step"}
PATHS = {"workdir", "output", "input", "results", "out", "path", "data",
         "init_checkpoint", "snapshots", "expert_states", "skip_calibration",
         "locomo", "table"}
ENDPOINTS = {"base_url", "model", "port"}
BUNDLED = "cmimem_jax/data/bundled/longmemeval_train_sample.json"
LOCOMO = "../shared/data/locomo/locomo10.json"


@dataclass(frozen=True)
class NotRun:
  """A command no test runs as a whole: why, and what runs its parts."""
  reason: str
  covered_by: tuple[str, ...]


_COVERED_BY_PARSING = "test_documented_configs_parse_and_validate"
_TRAIN_CLI = "tests/test_train.py::test_cli_one_writer_sigint_resume_and_summary"
COMMANDS: dict[str, str | NotRun] = {
    # --- README's recipe, docs/design.md, docs/tpu.md, the configs' ------
    "python -m cmimem_jax.train --config=configs/tiny.py --workdir=*":
        _TRAIN_CLI,
    "python -m cmimem_jax.train --config=configs/default.py --workdir=*":
        NotRun("one GRPO step of SmolLM2-135M takes 2-5 minutes on 2 cores "
               "(`make demo`'s GRPO stage)",
               (f"tests/test_documented_commands.py::{_COVERED_BY_PARSING}",
                _TRAIN_CLI)),
    "python -m cmimem_jax.train --config=configs/default.py --workdir=* "
    "--config.reward.alpha=0 --config.rollout.num_rollouts=* "
    "--config.mesh=fsdp:-1":
        NotRun("SmolLM2-135M GRPO with 8 rollouts: minutes per step",
               (f"tests/test_documented_commands.py::{_COVERED_BY_PARSING}",
                _TRAIN_CLI)),
    "python -m tools.reward_study --config=configs/reward_study.py "
    "--output=*":
        NotRun("about 1.5 minutes per LoCoMo conversation with MiniLM; the "
               "test runs the same `run()` on this config file with the "
               "hashing encoder",
               (f"tests/test_documented_commands.py::{_COVERED_BY_PARSING}",
                "tests/test_reward_study.py::"
                "test_a_run_writes_intervals_auc_and_spearman")),
    "make rehearsal":
        NotRun("the Makefile target is `rm -rf workdir/rehearsal` then "
               "`python -m tools.rehearse --workdir=workdir/rehearsal`; the "
               "test runs that script on a fresh workdir",
               ("tests/test_rehearse.py::"
                "test_the_recipe_rehearses_end_to_end",)),
    "python -m tools.build_expert_states --config=configs/qwen3_4b.py "
    "--config.dataset.path=* --config.encoder.path=* --output=* "
    "--base_url=* --model=*": "rehearsal:build_expert_states",
    "python -m tools.synthesize_qa --input=* --output=* --base_url=* "
    "--model=* --expert_states=* --per_session=* --max_tokens=* "
    "--temperature=0.0 --concurrency=8 --timeout_s=120":
        "rehearsal:synthesize_qa",
    "python -m tools.skip_calibration --config=configs/qwen3_4b.py "
    "--config.encoder.path=* --locomo=* --output=* --table=*":
        "rehearsal:skip_calibration",
    "python -m tools.skip_calibration "
    "--config=configs/qwen3_4b_h20_vllm.py ...":
        NotRun("needs the served encoder (an /v1/embeddings endpoint); the "
               "rehearsal calibrates the TPU config's encoder with the same "
               "tool, the test runs its `run()` on LoCoMo",
               (f"tests/test_documented_commands.py::{_COVERED_BY_PARSING}",
                "rehearsal:skip_calibration",
                "tests/test_reward_study.py::"
                "test_the_calibration_refuses_held_out_conversations")),
    "python -m cmimem_jax.train --config=configs/qwen3_4b_tpu.py "
    "--config.rl.snapshots=* --config.dataset.path=* "
    "--config.reward.skip_calibration=* ...": "rehearsal:train",
    "python -m cmimem_jax.train --config=configs/qwen3_4b_tpu.py --workdir=* "
    "--config.policy.path=* --config.encoder.path=* --config.dataset.path=* "
    "--config.rl.snapshots=* --config.reward.skip_calibration=* "
    "--config.qa.answer.base_url=* "
    "--config.qa.judge_endpoint.base_url=*": "rehearsal:train",
    "python -m tools.make_sft_data --input=* --dialogues=* "
    "--max_prompt_tokens=* --output=*":
        "tests/test_documented_commands.py::test_make_sft_data_commands",
    "python -m tools.make_sft_data --input=* --base_url=* --model=* "
    "--output=*":
        "tests/test_documented_commands.py::test_make_sft_data_commands",
    "python -m tools.make_sft_data --teacher=extractive "
    "--dataset=longmemeval --input=* --max_response_tokens=* --output=*":
        "tests/test_documented_commands.py::test_make_sft_data_commands",
    "python -m cmimem_jax.sft --config=configs/small_repro.py --workdir=* "
    "--config.sft.data=*":
        NotRun("a warm-start step of SmolLM2-135M compiles for minutes on "
               "2 cores; the test runs small_repro's `sft` section on the "
               "tiny policy",
               (f"tests/test_documented_commands.py::{_COVERED_BY_PARSING}",
                "tests/task/test_warm_start.py::"
                "test_sft_then_constrained_grpo_from_its_checkpoint")),
    "python -m cmimem_jax.train --config=configs/small_repro.py --workdir=* "
    "--config.policy.init_checkpoint=*":
        NotRun("constrained GRPO of SmolLM2-135M: minutes per step; the "
               "test runs GRPO from an SFT checkpoint on the tiny policy",
               (f"tests/test_documented_commands.py::{_COVERED_BY_PARSING}",
                "tests/task/test_warm_start.py::"
                "test_sft_then_constrained_grpo_from_its_checkpoint")),
    "python -m cmimem_jax.build_memory --config=configs/build_memory.py "
    "--workdir=* --config.dataset.dialogues=*":
        "tests/test_build_memory.py::test_demo_cli_builds_saves_and_reports",
    "python -m tools.reproduce --config=configs/small_repro.py --workdir=*":
        NotRun("hours on 2 cores (three GRPO arms in two seeds); the test "
               "runs the command with its stages recorded, and its stages "
               "one by one",
               ("tests/test_reproduce.py::"
                "test_the_documented_commands_run_the_whole_recipe",
                "tests/test_reproduce.py::"
                "test_stages_run_once_in_order_and_resume",
                "tests/test_reproduce.py::"
                "test_report_is_written_from_what_has_been_evaluated",
                "tests/task/test_warm_start.py::"
                "test_sft_then_constrained_grpo_from_its_checkpoint")),
    "python -m tools.reproduce --config=configs/small_repro.py --workdir=* "
    "--config.repro.other_learning_rates=(3e-6,3e-5)":
        NotRun("the recipe's arms at three learning rates in two seeds: "
               "hours on 2 cores; the test runs the command with its "
               "stages recorded, and the sweep's evaluation",
               ("tests/test_reproduce.py::"
                "test_the_documented_commands_run_the_whole_recipe",
                "tests/test_reproduce.py::"
                "test_an_arm_is_evaluated_from_the_rate_and_step_its_"
                "validation_picks")),
    "python -m cmimem_jax.train --config=configs/qwen3_4b_h20_vllm.py "
    "--workdir=* --config.policy.path=* --config.dataset.path=* "
    "--config.encoder.endpoint.base_url=* --config.rl.snapshots=* "
    "--config.reward.skip_calibration=* "
    "--config.qa.answer.base_url=* --config.qa.judge_endpoint.base_url=*":
        NotRun("needs vLLM and 8 GPUs; the rehearsal runs the TPU config, "
               "which differs only in hardware fields",
               (f"tests/test_documented_commands.py::{_COVERED_BY_PARSING}",
                "rehearsal:train",
                "tests/test_config.py::"
                "test_the_4b_hardware_configs_differ_only_in_hardware",
                "tests/test_train.py::"
                "test_vllm_engine_receives_the_restored_weights")),
    # --- README's recipe, docs/evaluation.md, the configs' docstrings -----
    "python -m cmimem_jax.evaluate --config=configs/eval_cpu.py --workdir=* "
    "--config.dataset.name=locomo --config.dataset.path=* "
    "--config.method=rag --config.rag_top_k=5 "
    "--config.judge.kind=context_recall":
        "tests/test_documented_commands.py::test_eval_cpu_commands",
    "python -m cmimem_jax.evaluate --config=configs/eval_cpu.py --workdir=*":
        "tests/test_documented_commands.py::test_eval_cpu_commands",
    "python -m cmimem_jax.evaluate --config=configs/eval_cpu.py --workdir=* "
    "--config.dataset.name=longmemeval --config.dataset.path=*":
        "tests/test_documented_commands.py::test_eval_cpu_commands",
    "python -m cmimem_jax.evaluate --config=configs/eval_cpu.py --workdir=* "
    "--config.method=rag --config.rag_top_k=5 --config.limit=*":
        "tests/test_documented_commands.py::test_eval_cpu_commands",
    "python -m cmimem_jax.evaluate --config=configs/eval_cpu.py --workdir=* "
    "--config.judge.kind=llm --config.answer.kind=endpoint "
    "--config.answer.endpoint.base_url=* --config.answer.endpoint.model=* "
    "--config.judge.endpoint.model=*":
        "tests/test_documented_commands.py::test_eval_cpu_commands",
    "python -m cmimem_jax.evaluate --config=configs/eval_qwen3_4b.py "
    "--workdir=* --config.dataset.path=* --config.encoder.path=* "
    "--config.builder.path=* --config.builder.init_checkpoint=* "
    "--config.builder.checkpoint_step=* --config.answer.endpoint.base_url=* "
    "--config.judge.endpoint.base_url=*": "rehearsal:evaluate",
    "python -m cmimem_jax.evaluate "
    "--config=configs/ablations/table3_rm.py":
        NotRun("the prompting pipeline with a Qwen3-4B builder; the "
               "rehearsal evaluates its base config (eval_qwen3_4b.py), the "
               "tests run the prompting method on CPU",
               (f"tests/test_documented_commands.py::{_COVERED_BY_PARSING}",
                "rehearsal:evaluate",
                "tests/evaluation/test_evaluate.py::"
                "test_prompting_method_builds_and_caches_banks")),
    "python -m tools.compare_paper --results=*": "rehearsal:compare_paper",
    # --- docs/serving.md, docs/tpu.md, docs/gpu.md -------------------------
    "python -m cmimem_jax.serve --config=configs/serve_cpu.py --port=*":
        "rehearsal:serve",
    "pip install -e .[gcs]":
        NotRun("installs from the network; `make install` installs the "
               "gcs extra, which the gs:// tests use",
               ("tests/test_gcs_workdir.py::"
                "test_train_on_a_bucket_resumes_after_kill_9",
                "tests/test_storage.py::"
                "test_a_missing_bucket_client_or_endpoint_is_one_line")),
    "pip install -e .[tpu]":
        NotRun("installs from the network; `make install`'s test extra "
               "installs the same jax[tpu], which the v5p-8 plans import",
               ("tests/test_plan.py::"
                "test_plan_compiles_the_train_step_and_rollout_for_a_v5p_8",)),
    "python -m tools.plan --config=configs/qwen3_4b_tpu.py --topology=v5p-8":
        "tests/test_plan.py::"
        "test_plan_compiles_the_train_step_and_rollout_for_a_v5p_8",
    "python -m tools.plan --config=configs/qwen3_4b_tpu.py --topology=v5p-8 "
    "--run":
        "tests/test_plan.py::"
        "test_plan_compiles_the_train_step_and_rollout_for_a_v5p_8",
}


# --- extraction ---------------------------------------------------------------


def document_commands() -> list[tuple[str, list[str]]]:
  """(where, words) of each command in the ```bash blocks of README.md and
  docs/*.md, every section but `UNREAD_SECTIONS`."""
  paths = sorted({os.path.relpath(path, REPO) for pattern in DOCUMENTS
                  for path in glob.glob(os.path.join(REPO, pattern))})
  found = []
  for path in paths:
    with open(os.path.join(REPO, path)) as f:
      text = f.read()
    for section in re.split(r"^(?=## )", text, flags=re.M):
      if section.startswith(UNREAD_SECTIONS):
        continue
      for block in re.findall(r"^```bash\n(.*?)^```", section,
                              flags=re.M | re.S):
        lines = block.splitlines()
        for i, line in enumerate(lines):
          if line.startswith(OPENINGS):
            found.append((path, rehearse.command_words(
                rehearse.continued(lines, i)[0])))
  return found


def docstring_commands(path: str) -> list[tuple[str, list[str]]]:
  """(where, words) of each command in module `path`'s docstring: its
  indented command lines, each `... --more` line (the command above it
  with more flags), and inline `python ... --config=...` spans."""
  with open(os.path.join(REPO, path)) as f:
    source = f.read()
  body = ast.parse(source).body
  if not (body and isinstance(body[0], ast.Expr)
          and isinstance(body[0].value, ast.Constant)):
    return []
  # The source lines, not the string's value: a `\` ending a line of a
  # non-raw docstring is gone from the value.
  lines = source.splitlines()[body[0].lineno - 1:body[0].end_lineno]
  found, base = [], []
  for i, line in enumerate(lines):
    text = rehearse.continued(lines, i)[0].strip()
    if line.startswith(" ") and line.strip().startswith(OPENINGS):
      base = rehearse.command_words(text)
      found.append(base)
    elif line.startswith(" ") and text.startswith("... --") and base:
      found.append(base + rehearse.command_words(text[len("..."):]))
  prose = " ".join(line.strip() for line in lines)
  found += [rehearse.command_words(span) for span in
            re.findall(r"`(python [^`]*--config=[^`]*)`", prose)]
  return [(path, words) for words in found]


def documented_commands() -> list[tuple[str, list[str]]]:
  configs = sorted(glob.glob(os.path.join(REPO, "configs", "*.py")) +
                   glob.glob(os.path.join(REPO, "configs", "ablations",
                                          "*.py")))
  found = document_commands()
  for path in configs:
    found += docstring_commands(os.path.relpath(path, REPO))
  return found


def _kind(word: str) -> str:
  """"size", "path", "endpoint" or "" (behaviour) for a `--flag=value`."""
  if not word.startswith("--") or "=" not in word:
    return ""
  leaf = word[2:].partition("=")[0].split(".")[-1]
  return ("size" if leaf in SIZES else "path" if leaf in PATHS
          else "endpoint" if leaf in ENDPOINTS else "")


def key(words: list[str]) -> str:
  """The command with the values of its size, path and endpoint flags
  blanked: equal keys are the same command up to those."""
  return " ".join(word.partition("=")[0] + "=*" if _kind(word) else word
                  for word in words)


# --- the registry's checks ----------------------------------------------------


def _test_source(node: str) -> str:
  """The source of test function `node` (`tests/x.py::test_y`)."""
  path, _, name = node.partition("::")
  with open(os.path.join(REPO, path)) as f:
    tree = ast.parse(f.read())
  with open(os.path.join(REPO, path)) as f:
    lines = f.read().splitlines()
  for item in tree.body:
    if isinstance(item, ast.FunctionDef) and item.name == name:
      return "\n".join(lines[item.lineno - 1:item.end_lineno])
  raise AssertionError(f"{node}: no such test function")


def _distinctive(words: list[str]) -> list[tuple[str, ...]]:
  """What a test that runs `words` must name, each as alternatives: the
  entry point (the module; a tool's `run_tool(tool, ...)` or `tool.run(`
too), the config file, every behaviour flag with its value."""
  module, rest = words[2], words[3:]
  needles = [(module,)]
  if module.startswith("tools."):
    tool = module.removeprefix("tools.")
    needles = [(module, f"run_tool({tool},", f"{tool}.run(")]
  for word in rest:
    if word.startswith("--config="):
      needles.append((word.partition("=")[2],))
    elif word.startswith("--") and not _kind(word):
      needles.append((word,))
  return needles


def _check_node(node: str, words: list[str] | None) -> None:
  if node.startswith("rehearsal:"):
    assert node.removeprefix("rehearsal:") in rehearse.DOCUMENTED, node
    return
  source = _test_source(node)
  for options in _distinctive(words) if words else ():
    assert any(o in source for o in options), (
        f"{node} does not run `{' '.join(words)}`: its source names none of "
        f"{options}")


def test_every_documented_command_has_an_entry():
  found = documented_commands()
  keys = {key(words) for _, words in found}
  missing = sorted({f"{where}: {key(words)}" for where, words in found
                    if key(words) not in COMMANDS})
  assert not missing, "documented commands no test runs:\n" + "\n".join(
      missing)
  assert not set(COMMANDS) - keys, f"stale entries: {set(COMMANDS) - keys}"
  # A Python command runs a module: an entry point or a tool of the
  # `tools` package (`python -m tools.NAME`), never a script's path.
  scripts = sorted({key(w) for _, w in found
                    if w[0] == "python" and w[1] != "-m"})
  assert not scripts, f"run as `python -m`: {scripts}"
  # Every place the documents and the configs write commands is read.
  assert {where for where, _ in found} >= {
      "README.md", "docs/design.md", "docs/evaluation.md", "docs/tpu.md",
      "docs/gpu.md", "docs/serving.md", "configs/eval_cpu.py",
      "configs/qwen3_4b_tpu.py", "configs/ablations/__init__.py"}


def test_the_quick_starts_commands_are_documented_ones():
  """README's first screen (Quick start) shows the TPU command as the 4B
  config's docstring writes it: each of its commands is one the registry
  above runs, word for word."""
  with open(os.path.join(REPO, "README.md")) as f:
    text = f.read()
  quick = re.split(r"^(?=## )", text, flags=re.M)[1]
  assert quick.startswith("## Quick start")
  commands = []
  for block in re.findall(r"^```bash\n(.*?)^```", quick, flags=re.M | re.S):
    lines = block.splitlines()
    commands += [rehearse.command_words(rehearse.continued(lines, i)[0])
                 for i, line in enumerate(lines)
                 if line.startswith(("python ", "pip "))]
  assert any(w[:4] == ["python", "-m", "cmimem_jax.train",
                       "--config=configs/qwen3_4b_tpu.py"] for w in commands)
  known = [words for _, words in documented_commands()]
  for words in commands:
    assert words in known, " ".join(words)


def test_each_entry_names_a_test_that_runs_its_command():
  for words in {key(w): w for _, w in documented_commands()}.values():
    entry = COMMANDS[key(words)]
    if isinstance(entry, NotRun):
      assert len(entry.reason) > 20 and entry.covered_by, key(words)
      for node in entry.covered_by:
        _check_node(node, None)
    else:
      _check_node(entry, words)


def test_rehearsal_entries_are_the_stages_commands():
  """Same words up to sizes, paths and endpoints; a command abbreviated
  with `...` names a part of the stage's."""
  for words in {key(w): w for _, w in documented_commands()}.values():
    entry = COMMANDS[key(words)]
    if isinstance(entry, str) and entry.startswith("rehearsal:"):
      stage = rehearse.documented_command(
          *rehearse.DOCUMENTED[entry.removeprefix("rehearsal:")])
      written, run = set(key(words).split()), set(key(stage).split())
      if "..." in written:
        assert written - {"..."} <= run, (words, stage)
      else:
        assert written == run, (words, stage)


def test_the_registry_check_fails_a_test_that_runs_another_command():
  with pytest.raises(AssertionError, match="names none of"):
    _check_node("tests/test_build_memory.py::"
                "test_demo_cli_builds_saves_and_reports",
                ["python", "-m", "cmimem_jax.train",
                 "--config=configs/tiny.py"])
  with pytest.raises(AssertionError, match="no such test"):
    _check_node("tests/test_train.py::test_gone", None)


def test_extraction_joins_lines_drops_comments_and_extends_variants(
    tmp_path):
  assert rehearse.command_words(
      'pip install -e ".[tpu]"   # libtpu [--x]') == [
          "pip", "install", "-e", ".[tpu]"]
  assert rehearse.command_words(
      "python t.py --results=/a[,/b] [--format=json]") == [
          "python", "t.py", "--results=/a"]
  module = tmp_path / "m.py"
  module.write_text('"""Doc.\n\n  python -m x --config=c.py \\\\\n'
                    '      --workdir=DIR\n  ... --config.k=1 \\\\\n'
                    '      --config.j=2\n'
                    '`python -m y --config=d.py` and `python -m z`\n"""\n')
  commands = [w for _, w in docstring_commands(str(module))]
  assert commands == [
      ["python", "-m", "x", "--config=c.py", "--workdir=DIR"],
      ["python", "-m", "x", "--config=c.py", "--workdir=DIR",
       "--config.k=1", "--config.j=2"],
      ["python", "-m", "y", "--config=d.py"]]
  assert key(commands[1]) == ("python -m x --config=c.py --workdir=* "
                              "--config.k=1 --config.j=2")


def test_commands_named_by_make_and_pip_exist():
  """`make X` names a Makefile target, `pip install -e ".[E]"` an extra of
  setup.py."""
  with open(os.path.join(REPO, "Makefile")) as f:
    targets = set(re.findall(r"^([\w-]+):", f.read(), flags=re.M))
  with open(os.path.join(REPO, "setup.py")) as f:
    extras = set(re.findall(r'^\s*"([\w-]+)": \[', f.read(), flags=re.M))
  for _, words in documented_commands():
    if words[0] == "make":
      assert words[1] in targets, words
    if words[:3] == ["pip", "install", "-e"]:
      match = re.fullmatch(r"\.\[([\w,-]+)\]", words[3])
      assert match and set(match.group(1).split(",")) <= extras, words


# --- running them ---------------------------------------------------------


def _written(entry_key: str) -> list[str]:
  """The documented command whose key is `entry_key` (the first place it is
  written)."""
  for _, words in documented_commands():
    if key(words) == entry_key:
      return words
  raise AssertionError(f"no documented command `{entry_key}`")


def _changed(words: list[str], changes: dict[str, object]) -> list[str]:
  """`words` with `--flag=value` changed or added for each of `changes`,
  each a size, path or endpoint; `python` is this interpreter."""
  for flag in changes:
    assert _kind(f"--{flag}=x"), f"--{flag} is not a size, path or endpoint"
  return rehearse.apply_overrides(words, changes, {}, strict=False)


def _parse(words: list[str]):
  """The config and workdir an entry point (`run_command`) reads from
  `words`, parsed by the same ml_collections flags, without running it."""
  from absl import flags
  from ml_collections import config_flags
  argv = ["prog", *(w.replace("--config=", f"--config={REPO}/", 1)
                    for w in words if w.startswith(("--config", "--workdir")))]
  values = flags.FlagValues()
  # The override flags (`--config.a.b`) are defined from the file that
  # `sys_argv` names, as `run_command` defines them from sys.argv.
  config_flags.DEFINE_config_file("config", None, "", flag_values=values,
                                  sys_argv=argv)
  flags.DEFINE_string("workdir", None, "", flag_values=values)
  values(argv)
  return values.config, values.workdir


@pytest.mark.slow
def test_make_sft_data_commands(tmp_path):
  """docs/design.md's three teacher commands: LoCoMo annotations, a chat model
  (the scripted stand-in answers the policy prompt), the extractive
  teacher; one LoCoMo conversation each."""
  output = str(tmp_path / "sft.jsonl")
  annotations = _written("python -m tools.make_sft_data --input=* "
                         "--dialogues=* --max_prompt_tokens=* --output=*")
  summary = run_tool(make_sft_data, _changed(annotations, {
      "dialogues": "0:1", "output": output})[3:])
  assert summary["records"] == 19 and summary["rejected"] == 0
  with scripted_llm.ScriptedLLM() as teacher:
    chat = _written("python -m tools.make_sft_data --input=* --base_url=* "
                    "--model=* --output=*")
    summary = run_tool(make_sft_data, _changed(chat, {
        "input": LOCOMO, "base_url": teacher.base_url, "model": "scripted",
        "output": output, "dialogues": "0:1"})[3:])
  assert summary["records"] == 19 and summary["rejected"] == 0
  extractive = _written("python -m tools.make_sft_data --teacher=extractive "
                        "--dataset=longmemeval --input=* "
                        "--max_response_tokens=* --output=*")
  summary = run_tool(make_sft_data,
                     _changed(extractive, {"output": output})[3:])
  assert summary["records"] == 15 and summary["rejected"] == 0


@pytest.mark.slow
def test_eval_cpu_commands(tmp_path):
  """configs/eval_cpu.py's command and its three variants, and docs/evaluation.md's
  evaluation command, parsed as the entry point parses them and run in
  this process (one MiniLM load), a few questions each; the LLM variant
  against a loopback endpoint. The entry point as a process is the
  rehearsal's (its `evaluate` stage)."""
  from cmimem_jax.evaluation.run import evaluate
  base = "python -m cmimem_jax.evaluate --config=configs/eval_cpu.py"
  sizes = {"config.dataset.dialogues": 1, "config.limit": 3}
  with FakeOpenAI() as endpoint:
    variants = {
        f"{base} --workdir=*": {},
        f"{base} --workdir=* --config.dataset.name=longmemeval "
        "--config.dataset.path=*": {},
        f"{base} --workdir=* --config.method=rag --config.rag_top_k=5 "
        "--config.limit=*": {},
        f"{base} --workdir=* --config.judge.kind=llm "
        "--config.answer.kind=endpoint --config.answer.endpoint.base_url=* "
        "--config.answer.endpoint.model=* --config.judge.endpoint.model=*": {
            "config.answer.endpoint.base_url": endpoint.base_url,
            "config.judge.endpoint.base_url": endpoint.base_url,
            "config.answer.endpoint.model": "fake",
            "config.judge.endpoint.model": "fake"},
        f"{base} --workdir=* --config.dataset.name=locomo "
        "--config.dataset.path=* --config.method=rag --config.rag_top_k=5 "
        "--config.judge.kind=context_recall": {},
    }
    runs = set()  # The parsed configs evaluated.
    for n, (entry, endpoints) in enumerate(variants.items()):
      config, workdir = _parse(_changed(_written(entry), {
          "workdir": str(tmp_path / str(n)), **sizes, **endpoints}))
      parsed = config.to_json_best_effort(sort_keys=True)
      if parsed in runs:
        # docs/evaluation.md's command is the rag variant with eval_cpu.py's dataset
        # and judge written out: the same config, so the same run.
        continue
      runs.add(parsed)
      result = evaluate(config, workdir)
      # The LongMemEval sample's first record has one question.
      assert 1 <= result["n"] <= 3 and not result["failures"], (entry,
                                                                 result)
      with open(os.path.join(workdir, "results.json")) as f:
        assert json.load(f)["n"] == result["n"]


# Stand-in values for the paths and endpoints of commands that are parsed
# and validated, not run.
def _fill(tmp_path) -> dict[str, str]:
  folder = str(tmp_path)
  (tmp_path / "sft.jsonl").write_text("")
  return {"workdir": folder, "config.dataset.path": BUNDLED,
          "config.encoder.path": folder, "config.policy.path": folder,
          "config.rl.snapshots": folder,
          "config.reward.skip_calibration": str(
              tmp_path / "skip_calibration.json"),
          "config.sft.data": str(
              tmp_path / "sft.jsonl"),
          "config.policy.init_checkpoint": folder,
          "config.builder.path": folder,
          "config.builder.init_checkpoint": folder,
          "config.encoder.endpoint.base_url": "http://127.0.0.1:9/v1",
          "config.qa.answer.base_url": "http://127.0.0.1:9/v1",
          "config.qa.judge_endpoint.base_url": "http://127.0.0.1:9/v1",
          "config.answer.endpoint.base_url": "http://127.0.0.1:9/v1",
          "config.judge.endpoint.base_url": "http://127.0.0.1:9/v1"}


def _has(config, dotted: str) -> bool:
  *parents, leaf = dotted.split(".")
  for part in parents:
    if part not in config:
      return False
    config = config[part]
  return leaf in config


# The sections each entry point validates (their `validate_config(...,
# required=...)`); a command of another entry point is only parsed.
ENTRY_SECTIONS = {
    "cmimem_jax.train": TRAINING_SECTIONS,
    "cmimem_jax.sft": SFT_SECTIONS,
    "cmimem_jax.evaluate": EVALUATION_SECTIONS,
    "tools.reward_study": (DatasetConfig, EncoderConfig, MemoryConfig,
                           RewardConfig),
}
# Devices of the machine a config is written for (else a one-CPU laptop).
CONFIG_DEVICES = {"configs/qwen3_4b_h20_vllm.py": 8}


def test_documented_configs_parse_and_validate(tmp_path, monkeypatch):
  """Each config command no test runs whole: its flags parse as the entry
  point parses them, and with only paths and endpoints filled in the
  sections its entry point uses pass validation, on a user's one-device
  machine, or the config's own hardware (not this process's 8 fake
  devices)."""
  import jax
  import ml_collections

  fill = _fill(tmp_path)
  validated = 0
  for entry, how in COMMANDS.items():
    if not (isinstance(how, NotRun) and "--config=" in entry):
      continue
    words = _written(entry)
    named = {w[2:].partition("=")[0] for w in words} & set(fill)
    if not named:  # An inline example: every path its config has.
      config, _ = _parse(words)
      named = {flag for flag in fill if flag == "workdir" or _has(
          config, flag.removeprefix("config."))}
    config, _ = _parse(_changed(words, {flag: fill[flag] for flag in named}))
    sections = ENTRY_SECTIONS.get(words[2])
    if sections is None:
      continue
    used = ml_collections.ConfigDict({
        name: value for name, value in config.items()
        if name in {kind.SECTION for kind in sections}
        or not isinstance(value, ml_collections.ConfigDict)})
    config_file = next(w.partition("=")[2] for w in words
                       if w.startswith("--config="))
    devices = jax.local_devices()[:CONFIG_DEVICES.get(config_file, 1)]
    with monkeypatch.context() as patch:
      patch.setattr(jax, "devices", lambda *_: devices)
      validate_config(used, required=sections)
    validated += 1
  assert validated >= 7
