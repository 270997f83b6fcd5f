"""One line for every bad input: an unknown config key names the nearest
known one, a garbage results file (compare_paper) or a malformed
rollouts file (skip_report) names the file and line, a run refused by its
inputs leaves no workdir, and a dead teacher endpoint (make_sft_data)
writes nothing."""

import functools
import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

from cmimem_jax.client import EndpointConfig
from cmimem_jax.config import unknown_field, unknown_override
from cmimem_jax.data import DatasetError
from cmimem_jax.task.loop import Trainer
from cmimem_jax.testing import run_tool
from tools import compare_paper, make_sft_data, skip_report

from test_train import tiny_config  # noqa: I100

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_an_unknown_override_names_the_field_and_the_nearest_known_one():
  config = tiny_config()
  assert unknown_field(config, "rl.steps") == (
      "unknown field rl.steps (nearest known: rl.max_steps)")
  assert unknown_field(config, "rll.max_steps") == (
      "unknown field rll.max_steps (nearest known: rl.max_steps)")
  assert unknown_field(config, "rl.max_steps") is None
  assert unknown_field(config, "zzz") == "unknown field zzz"
  assert unknown_override([
      "train", "--config=configs/tiny.py", "--config.rl.max_steps=3",
      "--config.rl.steps=-5"]) == (
          "unknown field rl.steps (nearest known: rl.max_steps)")
  assert unknown_override(["train", "--config=configs/tiny.py",
                           "--config.rl.max_steps=3"]) is None


def test_the_train_command_refuses_an_unknown_key_in_one_line(tmp_path):
  workdir = tmp_path / "run"
  done = subprocess.run(
      [sys.executable, "-m", "cmimem_jax.train", "--config=configs/tiny.py",
       f"--workdir={workdir}", "--config.rl.steps=-5"], cwd=ROOT,
      capture_output=True, text=True, timeout=300,
      env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert done.returncode == 2
  assert done.stderr.strip().splitlines() == [
      "error: unknown field rl.steps (nearest known: rl.max_steps) "
      "(--config FILE or a --config.KEY=VALUE override; CMIMEM_TRACEBACK=1 "
      "shows the traceback)"]
  assert not workdir.exists()


def test_a_dataset_that_fails_validation_leaves_no_workdir(tmp_path):
  data = tmp_path / "data.json"
  records = json.loads(pathlib.Path(tiny_config().dataset.path).read_text())
  del records[0]["haystack_sessions"]
  data.write_text(json.dumps(records))
  workdir = tmp_path / "run"
  with pytest.raises(DatasetError, match="haystack_sessions"):
    Trainer(tiny_config(**{"dataset.path": str(data)}), str(workdir))
  assert not workdir.exists()


def test_compare_paper_names_a_garbage_results_file(tmp_path, capsys):
  (tmp_path / "results.json").write_text('{"dataset": "locomo",\n'
                                         ' "overall": 0.5,\n garbage\n')
  with pytest.raises(SystemExit) as failed:
    run_tool(compare_paper, [f"--results={tmp_path}"])
  assert failed.value.code == 1
  # (The error's kind, the message, then the hint.)
  assert capsys.readouterr().err == (
      f"error: ValueError: {tmp_path / 'results.json'}:3:2: not JSON: "
      "Expecting property name enclosed in double quotes (--verbosity=1 "
      "shows the traceback)\n")
  (tmp_path / "results.json").write_text("[1, 2]")
  with pytest.raises(SystemExit):
    run_tool(compare_paper, [f"--results={tmp_path}"])
  assert capsys.readouterr().err == (
      f"error: ValueError: {tmp_path / 'results.json'}: not the results.json "
      "of `python -m cmimem_jax.evaluate` (needs 'dataset' and 'overall') "
      "(--verbosity=1 shows the traceback)\n")


def _run_dir(directory: pathlib.Path, rollouts: str) -> pathlib.Path:
  directory.mkdir()
  (directory / "config.json").write_text(tiny_config().to_json())
  (directory / "rollouts.jsonl").write_text(rollouts)
  return directory


@pytest.mark.parametrize("rollouts,expected", [
    ('{"step": 1, "session": "a/0"}\n{"step": 2, bad json\n{"step": 3}\n',
     ":2: malformed record: Expecting property name enclosed in double "
     "quotes: line 1 column 13 (char 12)"),
    ('{"step": 1, "session": "a/0"}\n["not", "a", "record"]\n',
     ": record 2 is not a rollout record (it needs an integer step and a "
     "session)"),
    ('{"step": 1, "session": "nobody/0"}\n',
     ": rollouts of sessions not in the run's dataset: ['nobody/0']"),
])
def test_skip_report_names_a_malformed_rollouts_file(tmp_path, capsys,
                                                     rollouts, expected):
  run = _run_dir(tmp_path / "run", rollouts)
  assert run_tool(skip_report, [str(run)]) == 1
  assert capsys.readouterr().err == f"{run / 'rollouts.jsonl'}{expected}\n"


def test_make_sft_data_with_a_dead_teacher_writes_nothing(tmp_path,
                                                          monkeypatch):
  with socket.socket() as probe:  # A port where nothing listens.
    probe.bind(("127.0.0.1", 0))
    dead = f"http://127.0.0.1:{probe.getsockname()[1]}/v1"
  monkeypatch.setattr(make_sft_data, "EndpointConfig",
                      functools.partial(EndpointConfig, max_retries=0))
  output = tmp_path / "sft.jsonl"
  with pytest.raises(SystemExit) as failed:
    run_tool(make_sft_data, [
        "--teacher=endpoint", f"--base_url={dead}", "--model=x",
        "--dataset=longmemeval", "--encoder=hashing", "--dim=32",
        f"--input={tiny_config().dataset.path}", f"--output={output}"])
  assert failed.value.code == (
      f"error: all 15 teacher calls to {dead} failed; nothing written to "
      f"{output}")
  assert not output.exists()
