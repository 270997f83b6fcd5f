import json
import subprocess
import sys

import pytest

from cmimem_jax.memory import MemoryBank


@pytest.mark.slow
def test_demo_cli_builds_saves_and_reports(tmp_path, locomo_path):
  result = subprocess.run(
      [sys.executable, "-m", "cmimem_jax.build_memory",
       "--config=configs/build_memory.py", f"--workdir={tmp_path}",
       f"--config.dataset.path={locomo_path}", "--config.dataset.dialogues=1",
       "--config.show_questions=1"],
      capture_output=True, text=True, timeout=600, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "CORE:APPEND|" in result.stdout
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert list(summary) == ["conv-26"]
  assert summary["conv-26"]["sessions"] == 19
  assert "invalid_responses" not in summary["conv-26"]
  bank = MemoryBank.load(str(tmp_path / "conv-26"))
  assert bank.step == 19 and len(bank) == summary["conv-26"]["entries"]
  # Deterministic (embedded MiniLM, annotation builder): pinned values as
  # the summary rounds them.
  assert summary["conv-26"]["entries"] == 209
  rewards = summary["conv-26"]["cmi_reward"]
  assert rewards["scored_operations"] == 228
  # Core lines join the conditioning set (§3.3): ρ is lower than without.
  # Sessions embedded whole (every LoCoMo session is over MiniLM's 256
  # tokens; truncated: 0.3269 / 0.0864).
  assert rewards["mean_cmi"] == 0.3498
  assert rewards["mean_rho_new"] == 0.1057
  # Only episodic / procedural hits bring their source turns (§4.1); the
  # annotation builder files most facts as semantic entries.
  assert summary["conv-26"]["evidence_recall"] == {
      "adversarial": 0.0, "multi-hop": 0.122, "open-domain": 0.136,
      "single-hop": 0.2, "temporal": 0.378}


def test_bad_config_fails_before_work(tmp_path):
  result = subprocess.run(
      [sys.executable, "-m", "cmimem_jax.build_memory",
       "--config=configs/build_memory.py", "--config.dataset.path=/nope.json"],
      capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode != 0
  assert "dataset.path='/nope.json'" in result.stderr
