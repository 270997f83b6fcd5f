"""`python -m cmimem_jax.evaluate` end to end: real LoCoMo and LongMemEval
files, offline and against a loopback endpoint with injected failures."""

import json
import os
import zlib

import pytest

from cmimem_jax.config import ConfigError, apply_overrides
from cmimem_jax.evaluation.run import evaluate

from fake_openai import FakeOpenAI  # noqa: I100

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "configs")


def eval_config(path, name="locomo", **overrides):
  import importlib.util
  spec = importlib.util.spec_from_file_location(
      "eval_cpu", os.path.join(CONFIGS, "eval_cpu.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  config.dataset.name, config.dataset.path = name, path
  # The hashing encoder keeps the full-file runs fast; MiniLM is the default.
  config.encoder.kind, config.encoder.dim = "hashing", 256
  return apply_overrides(config, overrides)


def read_jsonl(path):
  with open(path) as f:
    return [json.loads(line) for line in f]


def test_locomo_rag_context_recall_all_conversations(locomo_path, tmp_path):
  result = evaluate(eval_config(locomo_path), str(tmp_path))
  assert result["n"] == 1986 and result["failures"] == 0
  assert set(result["by_category"]) == {"adversarial", "multi-hop",
                                        "open-domain", "single-hop",
                                        "temporal"}
  assert 0.05 < result["overall"] < 0.9
  assert "without_adversarial" in result
  # Evidence turns retrieved by the top-10 turn search.
  assert 0.05 < result["evidence_recall"]["overall"] < 1.0
  saved = json.load(open(tmp_path / "results.json"))
  assert saved["overall"] == result["overall"]
  records = read_jsonl(tmp_path / "predictions.jsonl")
  assert len(records) == 1986
  assert all(len(r["retrieved"]) == 10 for r in records)


def test_longmemeval_sample_and_top_k(longmemeval_sample_path, tmp_path):
  results = {}
  for k in (1, 10):
    results[k] = evaluate(eval_config(longmemeval_sample_path, "longmemeval",
                                      rag_top_k=k), str(tmp_path / str(k)))
  assert results[10]["n"] == results[1]["n"] > 0
  # More retrieved turns can only add context.
  assert results[10]["overall"] >= results[1]["overall"]


def test_llm_judge_with_injected_failures_then_resume(locomo_path, tmp_path):
  def behaviour(content, attempt):
    bucket = zlib.crc32(content.encode()) % 6
    if bucket == 0:
      return "500"                         # Always fails.
    if bucket == 1:
      return "malformed"                   # Always fails.
    if bucket == 2 and attempt == 1:
      return "timeout"                     # Recovers on retry.
    if bucket == 3 and attempt == 1:
      return "500"                         # Recovers on retry.
    return "ok"

  with FakeOpenAI(behaviour, delay_s=0.6) as server:
    endpoint = dict(base_url=server.base_url, model="fake", timeout_s=0.4,
                    max_retries=1, backoff_s=0.01, concurrency=8)
    overrides = {"judge.kind": "llm", "answer.kind": "endpoint", "limit": 40}
    for section in ("answer", "judge"):
      for key, value in endpoint.items():
        overrides[f"{section}.endpoint.{key}"] = value
    config = eval_config(locomo_path, **overrides)
    result = evaluate(config, str(tmp_path))
    assert result["n"] == 40
    assert 0 < result["failures"] < 40
    assert result["scored"] == 40 - result["failures"]
    calls = result["call_failures"]
    failed = (sum(calls["answer"]["failed_calls"].values())
              + sum(calls["judge"]["failed_calls"].values()))
    assert failed == result["failures"]
    assert calls["answer"]["failed_attempts"].get("timeout", 0) > 0
    records = read_jsonl(tmp_path / "predictions.jsonl")
    failed_records = [r for r in records if r["score"] is None]
    assert len(failed_records) == result["failures"]
    assert all(r["error"] for r in failed_records)
    assert all("f1" in r for r in records if r["prediction"] is not None)

    # Resume against a healthy endpoint: only the failed ones are redone.
    server.behaviour = lambda c, a: "ok"
    requests_before = server.requests
    resumed = evaluate(config, str(tmp_path))
    assert resumed["failures"] == 0 and resumed["n"] == 40
    # Each redone question costs one answer and one judge request.
    assert server.requests - requests_before == 2 * result["failures"]


def test_prompting_method_builds_and_caches_banks(locomo_path, tmp_path):
  with FakeOpenAI() as server:
    config = eval_config(locomo_path, method="prompting", limit=5, **{
        "builder.endpoint.base_url": server.base_url,
        "builder.endpoint.model": "fake", "builder.endpoint.backoff_s": 0.01})
    config.dataset.dialogues = 1
    result = evaluate(config, str(tmp_path))
    # The fake model's answers are not agent JSON: every session's response
    # is invalid, counted, and the bank stays empty (core included).
    assert result["call_failures"]["build"]["invalid_build_responses"] == 19
    assert os.path.exists(tmp_path / "banks" / "prompting" / "conv-26")
    assert result["n"] == 5


def test_bad_config_is_reported_before_work(locomo_path, tmp_path):
  config = eval_config(locomo_path, method="nope", **{"judge.kind": "llm"})
  with pytest.raises(ConfigError) as error:
    evaluate(config, str(tmp_path))
  assert "method='nope'" in str(error.value)
  assert "needs an answer model" in str(error.value)
