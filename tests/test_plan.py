"""tools/plan.py: AOT compile of the real Qwen3-4B-shaped train step from
abstract shapes on the fake 8-device CPU mesh."""

import os
import sys

import jax
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import plan  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..")


@pytest.mark.slow
def test_plan_reports_memory_and_fit_for_a_sharded_mesh():
  if len(jax.devices()) < 8:
    pytest.skip("needs the 8 fake CPU devices set up in conftest")
  rows = plan.main([f"--config={ROOT}/configs/qwen3_4b_tpu.py",
                    "--mesh=fsdp:4,tensor:2", "--layers=1", "--length=256",
                    "--batch=1,2", "--budgets=16,32"])
  compiled, summary = rows[:2], rows[2]
  for row in compiled:
    assert row["arguments_gib"] > 0 and row["tflops_per_device_step"] > 0
  # More rows per device need more memory; the fit is affine.
  assert compiled[1]["per_device_total_gib"] > compiled[0][
      "per_device_total_gib"]
  assert summary["per_row_gib"] > 0
  # 1 layer of Qwen3-4B + embeddings, fp32 params and Adam moments, sharded
  # 8 ways: well under a GiB of arguments per device.
  assert compiled[0]["arguments_gib"] < 1.0
  fits = summary["max_per_device_batch"]
  assert fits["32GiB"] >= fits["16GiB"] >= 2
