"""`python -m tools.bench` end to end on shrunken shapes: every scenario runs,
prints its JSON line, and its built-in agreement checks against the peers
hold (the benchmark compares like with like)."""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _bench(env: dict[str, str], *args: str,
           pythonpath: pathlib.Path | None = None) -> list[dict]:
  """Runs the tool in `env` (`own_devices_env`: it sets its own device
  count; the suite's fast compile stays, as this checks agreement, not
  timings)."""
  if pythonpath is not None:
    env = dict(env, PYTHONPATH=os.pathsep.join(
        filter(None, [str(pythonpath), env.get("PYTHONPATH")])))
  result = subprocess.run(
      [sys.executable, "-m", "tools.bench", *args], cwd=ROOT, env=env,
      capture_output=True, text=True, timeout=600, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  rows = [json.loads(line) for line in result.stdout.splitlines()
          if line.startswith("{")]
  assert rows, result.stdout[-2000:]
  return rows


def _positive(value: float) -> bool:
  return math.isfinite(value) and value > 0


@pytest.mark.slow
def test_model_scenarios_agree_with_transformers(own_devices_env):
  small = ("--models=smollm2_135m", "--layers=1", "--reps=1")
  (forward,) = _bench(own_devices_env, "forward", *small, "--length=32")
  assert forward["max_abs_logit_diff"] < 1e-4
  (generate,) = _bench(own_devices_env, "generate", *small, "--length=16",
                       "--new_tokens=4")
  assert generate["greedy_token_agreement"] == 1.0
  for row in (forward, generate):
    assert _positive(row["speedup_vs_transformers"])
    assert _positive(row["ours_tokens_per_s"])
  (step,) = _bench(own_devices_env, "train_step", "--layers=1",
                   "--length=32", "--reps=1", "--group=2", "--completion=8",
                   "--frozen_weights")
  assert step["prompt"] == 24 and step["group"] == 2
  # Timings, not their order: one rep on a shared machine can rank a
  # smaller program slower (3.3 s vs 2.1 s seen under load).
  for key in ("train_step_over_forward", "shared_prompt_speedup",
              "adapter_gradient_speedup", "adapter_step_speedup_bound",
              "norms_only_gradient_s", "train_step_s"):
    assert _positive(step[key])


@pytest.mark.slow
def test_cmi_scenarios_agree_with_peers(own_devices_env):
  kernel, workload = _bench(own_devices_env, "cmi", "--quick", "--reps=1")
  assert kernel["max_abs_diff_vs_torch"] < 1e-6
  assert kernel["max_abs_diff_vs_numpy_loop"] < 1e-6
  assert workload["max_abs_reward_diff_vs_torch"] < 1e-6
  assert workload["max_abs_reward_diff_vs_numpy_loop"] < 1e-6
  for row in (kernel, workload):
    assert _positive(row["speedup_vs_torch_batched"])


def test_offsets_agree_with_prefix_decoding(own_devices_env):
  (row,) = _bench(own_devices_env, "offsets", "--tokens=400", "--reps=1")
  assert row["tokens"] == 400 and _positive(row["speedup"])


TUNIX_DIR = ROOT / ".tunix"


@pytest.mark.slow
def test_grpo_step_against_trl_and_tunix_does_the_same_work(
    own_devices_env):
  if not (TUNIX_DIR / "tunix").is_dir():
    pytest.skip("Tunix, the second peer, is not installed: `make tunix-peer` "
                "(run by `make test`) puts it in .tunix/")
  (row,) = _bench(own_devices_env, "grpo_step", "--layers=1", "--prompts=2",
                  "--group=2", "--new_tokens=8", "--steps=1", "--devices=2",
                  "--peers=trl,tunix", pythonpath=TUNIX_DIR)
  assert row["layers"] == 1
  assert row["ours"]["tokens"] == 2 * 2 * 8 and row["ours"]["rows"] == 4
  # Each prompt ran once for its two rows (one per device).
  assert row["ours"]["prompt_group"] == 2
  for peer in ("trl", "tunix"):
    assert row[f"same_work_{peer}"], row
    assert _positive(row[f"vs_{peer}"])
  # Tunix runs the same model (its Llama port of the same weights) and
  # updates the same columns: its prompts padded as ours are.
  assert row["tunix"]["max_abs_logit_diff"] < 1e-3
  assert row["tunix"]["update_columns"] == row["ours"]["update_columns"]
  for side in ("ours", "trl", "tunix"):
    assert all(_positive(row[side][k]) for k in ("rollout_s", "update_s",
                                                 "step_s"))
