"""`tools/device_check.py --small` on the CPU: the CPU-capable checks run
and agree with their peers; the accelerator-only ones skip with a reason."""


import pytest

from cmimem_jax.testing import run_tool
from tools import device_check


@pytest.mark.slow
def test_small_checks_on_cpu(capsys):
  results = {r["check"]: r for r in run_tool(device_check, ["--small"])}
  assert set(results) == set(device_check.CHECKS)
  assert not [r for r in results.values() if "error" in r], results
  # One JSON line per check on stdout.
  assert len(capsys.readouterr().out.strip().splitlines()) == len(results)
  assert "cuDNN" in results["attention"]["skipped"]
  assert "vLLM" in results["vllm"]["skipped"]
  sampler = results["sampler"]
  assert sampler["greedy_token_agreement"] == 1.0
  assert sampler["ours_tokens_per_s"] > 0
  kernel = results["cmi_kernel"]
  assert kernel["max_abs_diff_vs_torch"] < 1e-5 and kernel["ours_ms"] > 0
  step = results["grpo_step"]
  assert step["step_s"] > 0 and step["rows"] == 2 * step["devices"]
  assert step["sample_s"] > 0 and step["update_s"] > 0
