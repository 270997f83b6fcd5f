"""tools/plan.py: AOT compile of the real Qwen3-4B-shaped programs from
abstract shapes, on the fake 8-device CPU mesh and for a TPU topology
(libtpu, from the test extras)."""

import os
import sys

import jax
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import plan  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..")
MEMORY_FIELDS = ("arguments_gib", "temporaries_gib", "outputs_gib",
                 "aliased_gib", "total_gib", "xla_tflops", "xla_bytes_accessed_gib",
                 "model_tflops", "model_bytes_gib")


@pytest.mark.slow
def test_plan_reports_memory_and_fit_for_a_sharded_mesh():
  if len(jax.devices()) < 8:
    pytest.skip("needs the 8 fake CPU devices set up in conftest")
  rows = plan.main([f"--config={ROOT}/configs/qwen3_4b_tpu.py",
                    "--topology=cpu:8", "--programs=train",
                    "--mesh=fsdp:4,tensor:2", "--layers=1", "--length=256",
                    "--batch=1,2", "--budgets=16,32"])
  compiled, summary = rows[:2], rows[2]
  for row in compiled:
    assert row["arguments_gib"] > 0 and row["xla_tflops"] > 0
    assert row["attention_impl"] == "per_head" and "fits" not in row
  # More rows per device need more memory; the fit is affine.
  assert compiled[1]["total_gib"] > compiled[0]["total_gib"]
  assert summary["per_row_gib"] > 0
  # 1 layer of Qwen3-4B + embeddings, fp32 params and Adam moments, sharded
  # 8 ways: well under a GiB of arguments per device.
  assert compiled[0]["arguments_gib"] < 1.0
  fits = summary["max_rows_per_chip"]
  assert fits["32GiB"] >= fits["16GiB"] >= 2


@pytest.mark.slow
def test_plan_compiles_the_train_step_and_rollout_for_a_v5p_8():
  pytest.importorskip("libtpu", reason="the TPU extra is not installed")
  rows = plan.main([f"--config={ROOT}/configs/qwen3_4b_tpu.py",
                    "--topology=v5p-8", "--layers=1", "--length=512",
                    "--completion=128"])
  assert [r["program"] for r in rows] == ["train", "rollout_prefill",
                                          "rollout_decode"]
  for row in rows:
    assert row["device_kind"] == "TPU v5" and row["devices"] == 4
    assert row["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1}
    assert all(row[field] >= 0 for field in MEMORY_FIELDS)
    assert row["total_gib"] > 0 and row["xla_bytes_accessed_gib"] > 0
    assert row["hbm_gib"] == 95 and row["fits"] is True
    assert row["bound"] in ("compute", "memory") and row["roofline_s"] > 0
  train, prefill, decode = rows
  # With one layer XLA counts every FLOP (no loop to count once): the
  # model's own count agrees with it.
  for row in (train, prefill):
    assert 0.9 < row["model_tflops"] / row["xla_tflops"] < 1.1
  assert train["attention_impl"] == prefill["attention_impl"] == "splash"
  # A training step does far more work than one decoded token.
  assert (train["model_tflops"] > prefill["model_tflops"]
          > decode["model_tflops"] > 0)
  with pytest.raises(SystemExit, match="v5p-8"):
    plan.main([f"--config={ROOT}/configs/qwen3_4b_tpu.py",
               "--topology=v7x-8"])


def test_plan_compiles_the_cmi_kernel_for_a_v5p_8():
  pytest.importorskip("libtpu", reason="the TPU extra is not installed")
  (row,) = plan.main([f"--config={ROOT}/configs/qwen3_4b_tpu.py",
                      "--topology=v5p-8", "--programs=cmi_kernel",
                      "--batch=16", "--cmi_shape=8,128"])
  assert row["program"] == "cmi_kernel" and row["cmi_shape"] == [8, 128]
  assert row["global_batch"] == 16 * row["devices"]
  assert row["total_gib"] > 0 and row["fits"] is True
  assert row["bound"] in ("compute", "memory")
  assert "layers" not in row and "length" not in row
