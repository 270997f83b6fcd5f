"""`tools/skip_report.py`: semantic SKIPs of logged rollouts, by kind of
session, counted as the reward logged them."""

import json
import pathlib

import pytest

from cmimem_jax.data.registry import bundled_path
from cmimem_jax.testing import run_tool
from tools import skip_report


FILLER = "longmemeval_train_with_filler.json"


def _workdir(path: pathlib.Path, records: list[dict],
             dataset: str = bundled_path(FILLER)) -> str:
  path.mkdir()
  (path / "config.json").write_text(json.dumps({"dataset": {
      "name": "longmemeval", "split": "", "dialogues": 0, "path": dataset}}))
  (path / "rollouts.jsonl").write_text(
      "".join(json.dumps(r) + "\n" for r in records))
  return str(path)


def _skip(session: str, justified: bool, rho: float) -> dict:
  return {"step": 1, "session": session, "semantic_skip": 1.0,
          "semantic_skip_justified": float(justified),
          "semantic_skip_rho": rho}


def test_counts_by_kind_per_run_and_pooled(tmp_path, capsys):
  # train_maya: session 1 is maya_f1 (the user only asks), 0 is maya_s1.
  first = _workdir(tmp_path / "a", [
      _skip("train_maya/1", True, 0.0),
      {"step": 1, "session": "train_maya/1", "semantic_skip": 0.0},
      _skip("train_maya/0", False, 0.7),
      _skip("train_maya/0", True, 0.1)])
  second = _workdir(tmp_path / "b", [
      {"step": 1, "session": "train_maya/3", "semantic_skip": 0.0},
      _skip("train_maya/2", False, 0.5)])
  assert run_tool(skip_report, [first, second, "--output",
                                str(tmp_path / "out.json"), "--plot",
                                str(tmp_path / "skips.png")]) == 0
  assert (tmp_path / "skips.png").read_bytes()[:4] == b"\x89PNG"
  counts = json.loads((tmp_path / "out.json").read_text())
  assert counts[first] == {
      "states nothing": {"rollouts": 2, "skips": 1, "justified": 1,
                         "skip_rho_mean": 0.0},
      "states something": {"rollouts": 2, "skips": 2, "justified": 1,
                           "skip_rho_mean": pytest.approx(0.4)}}
  assert counts[second]["states nothing"] == {
      "rollouts": 1, "skips": 0, "justified": 0, "skip_rho_mean": None}
  assert counts["pooled"]["states something"] == {
      "rollouts": 3, "skips": 3, "justified": 1,
      "skip_rho_mean": pytest.approx(1.3 / 3)}
  table = capsys.readouterr().out
  assert f"| {first} | states nothing | 2 | 1 | 1 | 0.000 |" in table
  assert "| pooled | states nothing | 3 | 1 | 1 | 0.000 |" in table


def test_a_step_range_and_runs_without_rollouts(tmp_path, capsys):
  run = _workdir(tmp_path / "a", [
      {**_skip("train_maya/1", True, 0.0), "step": 1},
      {**_skip("train_maya/3", True, 0.0), "step": 2},
      {**_skip("train_maya/0", False, 0.6), "step": 3}])
  assert run_tool(skip_report, [run, "--steps=2:3", "--output",
                                str(tmp_path / "out.json")]) == 0
  counts = json.loads((tmp_path / "out.json").read_text())[run]
  assert [(c["rollouts"], c["skips"], c["justified"])
          for c in counts.values()] == [(1, 1, 1), (1, 1, 0)]
  capsys.readouterr()
  assert run_tool(skip_report, [run, "--steps=4:9"]) == 1
  assert ("no logged rollouts in steps 4..9 (it logged steps 1..3)"
          in capsys.readouterr().err)
  empty = _workdir(tmp_path / "b", [])
  assert run_tool(skip_report, [empty]) == 1
  assert "rl.log_rollouts=True" in capsys.readouterr().err
  assert run_tool(skip_report, [str(tmp_path / "nope")]) == 1
  assert "no such directory" in capsys.readouterr().err
  for bad in ("--steps=3", "--steps=3:2"):
    with pytest.raises(SystemExit):
      run_tool(skip_report, [run, bad])


def test_a_run_trained_with_a_relative_dataset_path(tmp_path, monkeypatch,
                                                     capsys):
  """As the documented commands train, from the repository root: the
  report finds the dataset from any directory."""
  relative = f"cmimem_jax/data/bundled/{FILLER}"
  run = _workdir(tmp_path / "a", [_skip("train_maya/1", True, 0.0)],
                 dataset=relative)
  monkeypatch.chdir(tmp_path)
  assert run_tool(skip_report, [run]) == 0
  assert "| states nothing | 1 | 1 | 1 | 0.000 |" in capsys.readouterr().out
  missing = _workdir(tmp_path / "b", [_skip("train_maya/1", True, 0.0)],
                     dataset="no/such/data.json")
  assert run_tool(skip_report, [missing]) == 1
  assert "'no/such/data.json' is not found" in capsys.readouterr().err


def test_a_run_still_writing_is_read_not_repaired(tmp_path, capsys):
  run = _workdir(tmp_path / "a", [_skip("train_maya/1", True, 0.0)])
  rollouts = tmp_path / "a" / "rollouts.jsonl"
  with open(rollouts, "a") as f:
    f.write('{"step": 2, "session": "train_ma')  # A line being written.
  written = rollouts.read_bytes()
  assert run_tool(skip_report, [run]) == 0
  assert "| states nothing | 1 | 1 | 1 | 0.000 |" in capsys.readouterr().out
  assert rollouts.read_bytes() == written
