"""`python -m cmimem_jax.evaluate` end to end: real LoCoMo and LongMemEval
files, offline and against a loopback endpoint with injected failures."""

import json
import os
import socket
import threading
import time
import zlib

import pytest

from cmimem_jax.config import (CallsFailed, ConfigError, apply_overrides,
                               check_failures, validate_config)
from cmimem_jax.data import load_locomo
from cmimem_jax.data.files import write_json
from cmimem_jax.evaluation.run import (EVALUATION_SECTIONS, evaluate,
                                       failed_endpoints, result_settings,
                                       text_metrics)
from cmimem_jax.testing.fake_openai import FakeOpenAI
from configs import eval_cpu, paper, qwen3_4b_h20_vllm


def eval_config(path, name="locomo", **overrides):
  config = eval_cpu.get_config()
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
  # Category 5 has no gold to find in a context (its gold is the refusal):
  # unscorable by context recall, never scored 0 or 1.
  assert result["unscorable"] == result["n_by_category"]["adversarial"] == 446
  assert set(result["by_category"]) == {"multi-hop", "open-domain",
                                        "single-hop", "temporal"}
  # Deterministic (hashing encoder, exact FAISS search): pinned values.
  assert result["overall"] == pytest.approx(0.141558441558, abs=1e-9)
  assert result["without_adversarial"] == result["overall"]
  # Evidence turns retrieved by the top-10 turn search.
  assert result["evidence_recall"]["overall"] == pytest.approx(
      0.204888579236, abs=1e-9)
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


def agent_reply(content):
  """Valid answers of the four JSON agents (Listings 1-4), in the shapes
  LLMs give them (prose, a code fence), one fact per session."""
  fact = zlib.crc32(content.encode()) % 10_000
  if "Core Memory Manager" in content:
    return f'Here you go: {{"operation": "APPEND", "content": "fact {fact}"}}'
  if "Episodic Memory Manager" in content:
    return ('```json\n{"operations": [{"action": "ADD", "memory": '
            f'"2023-05-08: event {fact} | Details: at the group"}}]}}\n```')
  if "Semantic Memory Manager" in content:
    return '{"operations": [{"action": "SKIP", "reason": "nothing new"}]}'
  return '{"operations": []}'


def test_prompting_method_builds_a_bank_from_valid_agents_and_reuses_it(
    locomo_path, tmp_path):
  with FakeOpenAI(reply=agent_reply) as server:
    overrides = {"method": "prompting", "dataset.dialogues": 1,
                 "builder.endpoint.base_url": server.base_url,
                 "builder.endpoint.model": "fake"}
    result = evaluate(eval_config(locomo_path, limit=5, **overrides),
                      str(tmp_path))
    assert result["call_failures"]["build"] == {"invalid_build_responses": 0}
    assert server.requests == 19 * 4  # Four agents per session.
    from cmimem_jax.memory import MemoryBank, MemoryType
    bank = MemoryBank.load(str(tmp_path / "banks" / "prompting" / "conv-26"))
    assert bank.step == 19 and len(bank.core.splitlines()) == 19
    assert len(bank.stores[MemoryType.EPISODIC].entries) == 19
    assert not bank.stores[MemoryType.SEMANTIC].entries
    # More questions of the same dialogue: the cached bank, no new calls.
    more = evaluate(eval_config(locomo_path, limit=8, **overrides),
                    str(tmp_path))
    assert server.requests == 19 * 4 and more["n"] == 8
    records = read_jsonl(tmp_path / "predictions.jsonl")
    ids = {e.entry_id for e in bank.stores[MemoryType.EPISODIC].entries}
    assert all(record["retrieved"] and set(record["retrieved"]) <= ids
               for record in records)


def test_a_failed_builder_call_caches_no_bank_and_scores_nothing_on_it(
    locomo_path, tmp_path):
  """The builder's endpoint is down: no bank is cached and none of the
  dialogue's questions is scored (`missing`); the gate names the builder's
  URL. The rerun against a working builder builds the bank and scores
  them all."""
  with socket.socket() as probe:  # A port where nothing listens.
    probe.bind(("127.0.0.1", 0))
    dead = f"http://127.0.0.1:{probe.getsockname()[1]}/v1"
  overrides = {"method": "prompting", "dataset.dialogues": 1,
               "builder.endpoint.model": "fake",
               "builder.endpoint.max_retries": 0}
  config = eval_config(locomo_path, limit=5, **overrides,
                       **{"builder.endpoint.base_url": dead})
  result = evaluate(config, str(tmp_path))
  assert result["n"] == 0 and result["missing"] == 5
  assert result["call_failures"]["build"]["unbuilt_dialogues"] == 1
  assert not os.path.exists(tmp_path / "banks" / "prompting" / "conv-26")
  sections = validate_config(config, required=EVALUATION_SECTIONS)
  assert failed_endpoints(sections, result) == f"builder {dead}"
  with pytest.raises(CallsFailed, match=f"^all 5 questions could not be "
                     f"scored: calls to builder {dead} failed"):
    check_failures(result["failures"] + result["missing"],
                   result["n"] + result["missing"], 0.0,
                   "questions could not be scored: calls to "
                   f"{failed_endpoints(sections, result)}")
  with FakeOpenAI(reply=agent_reply) as server:
    config.builder.endpoint.base_url = server.base_url
    rerun = evaluate(config, str(tmp_path))
  assert rerun["n"] == 5 and rerun["missing"] == 0
  assert os.path.exists(tmp_path / "banks" / "prompting" / "conv-26")


# settings.json as the raw config gave it before the sections were typed,
# one file per case below (the path of the case's tmp folder as `<tmp>`).
SETTINGS_GOLDEN = os.path.join(os.path.dirname(__file__), "settings_golden")


@pytest.mark.parametrize("case,overrides", [
    ("rag", {}),
    ("prompting_llm_judge",
     {"method": "prompting", "judge.kind": "llm", "answer.kind": "endpoint",
      "memory.update_match_threshold": 1, "encoder.dim": 128}),
    ("policy_external_summarizer",
     {"method": "policy", "builder.kind": "local", "builder.path": "/m.gguf",
      "memory.merge_summarizer": "external",
      "memory.summarizer_endpoint.model": "summarizer"}),
    ("paper_encoder", None), ("openai_encoder", None)])
def test_settings_json_is_byte_identical_to_the_untyped_configs(
    locomo_path, tmp_path, case, overrides):
  """A workdir's `settings.json` is what a resumed evaluation compares:
  built from the typed sections it is byte for byte what the raw config
  gave (`settings_golden/`, written by the code before the sections were
  typed: keys sorted, an encoder field the config leaves out left out, a
  nested endpoint as given), so a run started before then resumes."""
  config = eval_config(locomo_path)
  if case == "paper_encoder":  # A query instruction, no endpoint.
    config.encoder = paper.encoder()
    config.encoder.path = str(tmp_path)  # A checkpoint folder.
  elif case == "openai_encoder":  # A nested endpoint section.
    config.encoder = qwen3_4b_h20_vllm.get_config().encoder
  else:
    for key, value in overrides.items():
      *parents, leaf = key.split(".")
      node = config
      for part in parents:
        node = node[part]
      with node.ignore_type():  # An int where the file has a float.
        node[leaf] = value
  sections = validate_config(config, required=EVALUATION_SECTIONS)
  written = tmp_path / "settings.json"
  write_json(str(written), result_settings(sections))
  with open(os.path.join(SETTINGS_GOLDEN, f"{case}.json"), "rb") as golden:
    assert written.read_bytes().replace(str(tmp_path).encode(),
                                        b"<tmp>") == golden.read()


def test_bad_config_is_reported_before_work(locomo_path, tmp_path):
  config = eval_config(locomo_path, method="nope", **{"judge.kind": "llm"})
  with pytest.raises(ConfigError) as error:
    evaluate(config, str(tmp_path))
  assert "method='nope'" in str(error.value)
  assert "needs an answer model" in str(error.value)


def test_torn_predictions_tail_is_repaired_and_resumed(locomo_path, tmp_path):
  config = eval_config(locomo_path, limit=30)
  first = evaluate(config, str(tmp_path))
  path = tmp_path / "predictions.jsonl"
  lines = path.read_text().splitlines(keepends=True)
  # A hard kill while writing the 21st record.
  path.write_text("".join(lines[:20]) + lines[20][:37])
  resumed = evaluate(config, str(tmp_path))
  records = read_jsonl(path)
  assert len(records) == 30  # The torn record was redone, once.
  assert len({r["question_id"] for r in records}) == 30
  assert resumed["overall"] == first["overall"]


def test_a_rerun_with_other_settings_is_refused(locomo_path, tmp_path):
  evaluate(eval_config(locomo_path, limit=3), str(tmp_path))
  # The subset may change; what decides a record may not.
  evaluate(eval_config(locomo_path, limit=5), str(tmp_path))
  with pytest.raises(ValueError, match=r"rag_top_k: 10 -> 5"):
    evaluate(eval_config(locomo_path, limit=3, rag_top_k=5), str(tmp_path))
  with pytest.raises(ValueError, match=r"encoder: .*'dim': 256.* -> .*128"):
    evaluate(eval_config(locomo_path, limit=3, **{"encoder.dim": 128}),
             str(tmp_path))


def test_a_run_stopped_by_a_missing_checkpoint_records_no_settings(
    locomo_path, tmp_path, monkeypatch):
  """The builder's checkpoint is missing: the run stops before any result
  and leaves no settings behind, so the corrected command may use the same
  workdir."""
  import cmimem_jax.evaluation.run as run

  def no_checkpoint(section, constraint_regex=None):
    del constraint_regex  # As `load_model_weights` fails on a wrong path:
    raise FileNotFoundError(f"no checkpoint in {section.init_checkpoint}")

  monkeypatch.setattr(run, "make_chat_model", no_checkpoint)
  workdir = str(tmp_path / "eval")
  with pytest.raises(FileNotFoundError, match="no_such_run"):
    evaluate(eval_config(locomo_path, limit=2, method="prompting", **{
        "builder.kind": "local",
        "builder.init_checkpoint": str(tmp_path / "no_such_run")}), workdir)
  assert not os.path.exists(os.path.join(workdir, "settings.json"))
  monkeypatch.undo()
  assert evaluate(eval_config(locomo_path, limit=2), workdir)["n"] == 2
  assert os.path.exists(os.path.join(workdir, "settings.json"))


def test_a_same_named_file_with_other_content_is_not_reused(locomo_path,
                                                            tmp_path):
  """The settings fingerprint holds the file's content, not its name: the
  same name in another folder with other evidence is refused."""
  with open(locomo_path) as f:
    conversations = json.load(f)[:1]
  (tmp_path / "a").mkdir()
  (tmp_path / "b").mkdir()
  (tmp_path / "a" / "locomo.json").write_text(json.dumps(conversations))
  conversations[0]["qa"][0]["evidence"] = ["D1:1"]
  (tmp_path / "b" / "locomo.json").write_text(json.dumps(conversations))
  out = str(tmp_path / "out")
  evaluate(eval_config(str(tmp_path / "a" / "locomo.json"), limit=3), out)
  with pytest.raises(ValueError, match="dataset_sha256"):
    evaluate(eval_config(str(tmp_path / "b" / "locomo.json"), limit=3), out)


def test_reruns_keep_unscorable_records_and_time_themselves(locomo_path,
                                                            tmp_path):
  """An identical rerun redoes nothing (unscorable category-5 questions
  included: 497 -> 609 lines before) and `seconds` is the run's wall time."""
  config = eval_config(locomo_path, **{"dataset.dialogues": 1})
  first = evaluate(config, str(tmp_path))
  lines = (tmp_path / "predictions.jsonl").read_text().count("\n")
  assert first["unscorable"] > 0 and lines == first["n"]
  again = evaluate(config, str(tmp_path))
  assert (tmp_path / "predictions.jsonl").read_text().count("\n") == lines
  assert again["overall"] == first["overall"]
  assert 0 <= first["seconds"] < 600 and 0 <= again["seconds"] < 600


@pytest.mark.parametrize("content", ["[]", ""])
def test_an_empty_dataset_is_an_error_not_n_0(tmp_path, content):
  path = tmp_path / "empty.json"
  path.write_text(content)
  with pytest.raises(ValueError, match="empty.json"):
    evaluate(eval_config(str(path)), str(tmp_path / "out"))


def test_repeated_question_ids_are_refused(locomo_path, tmp_path):
  with open(locomo_path) as f:
    conversations = json.load(f)[:1]
  conversations.append(conversations[0])  # Same sample_id twice.
  path = tmp_path / "twice.json"
  path.write_text(json.dumps(conversations))
  with pytest.raises(ValueError, match="question ids occur more than once"):
    evaluate(eval_config(str(path)), str(tmp_path / "out"))


def test_judged_as_answered_and_records_flushed_in_order(locomo_path,
                                                        tmp_path):
  """Every answer call is sent at once (2 in flight), each judged as soon
  as it is answered, and each record is on disk as soon as it and those
  before it are scored: a run killed midway keeps its paid calls."""
  calls = []  # (judge?, records on disk) per request, in arrival order.
  lock = threading.Lock()
  with FakeOpenAI() as server:
    def behaviour(content, attempt):
      del attempt
      path = tmp_path / "predictions.jsonl"
      with lock:
        calls.append(("Gold answer" in content,
                      len(read_jsonl(path)) if path.exists() else 0))
      time.sleep(0.1)
      return "ok"
    server.behaviour = behaviour
    overrides = {"judge.kind": "llm", "answer.kind": "endpoint", "limit": 12}
    for section in ("answer", "judge"):
      overrides[f"{section}.endpoint.base_url"] = server.base_url
      overrides[f"{section}.endpoint.model"] = "fake"
      overrides[f"{section}.endpoint.concurrency"] = 2
    # LoCoMo's F1 loads its stemmer on first use (0.7 s): loaded before,
    # so the first record's write time is the pipeline's, not an import's.
    text_metrics("locomo", load_locomo(locomo_path)[0].questions[0], "")
    evaluate(eval_config(locomo_path, **overrides), str(tmp_path))
  records = read_jsonl(tmp_path / "predictions.jsonl")
  assert len(calls) == 24 and len(records) == 12
  # The first verdict is asked before the last answers; records are
  # written while answers are still being asked.
  judged = [is_judge for is_judge, _ in calls]
  last_answer = max(i for i, j in enumerate(judged) if not j)
  assert judged.index(True) < last_answer
  assert calls[last_answer][1] > 0
  # In the questions' order, whatever order the calls finished in.
  assert [r["question_id"] for r in records] == [
      q.question_id for d in load_locomo(locomo_path) for q in d.questions
  ][:12]
  assert all(r["score"] is not None for r in records)


@pytest.mark.slow
def test_policy_method_with_local_builder_and_answer_model(
    longmemeval_sample_path, tmp_path):
  """`method=policy` end to end with our Flax model as the constrained
  memory builder and as the answer model (a tiny random Qwen3 with the
  embedded tokenizer), judged by an endpoint."""
  from flax import nnx
  from cmimem_jax.memory import MemoryBank
  from cmimem_jax.models.qwen3 import Qwen3, preset
  from cmimem_jax.models.qwen3.params import save_hf
  from cmimem_jax.sampling import load_tokenizer
  tokenizer = load_tokenizer("")
  model_dir = str(tmp_path / "tiny_policy")
  save_hf(Qwen3(preset("tiny", vocab_size=len(tokenizer),
                       max_position_embeddings=16384), rngs=nnx.Rngs(0)),
          model_dir)
  tokenizer.save_pretrained(model_dir)
  with FakeOpenAI() as judge:
    config = eval_config(longmemeval_sample_path, "longmemeval", **{
        "method": "policy", "judge.kind": "llm",
        "judge.endpoint.base_url": judge.base_url,
        "judge.endpoint.model": "fake",
        "builder.kind": "local", "builder.path": model_dir,
        "builder.max_new_tokens": 64, "builder.constrained_dsl": True,
        "answer.kind": "local", "answer.path": model_dir,
        "answer.max_new_tokens": 8})
    result = evaluate(config, str(tmp_path / "eval"))
    assert judge.requests == 2  # Only the judge is remote.
  # Constrained decoding: every session's response is valid DSL, applied.
  assert result["call_failures"]["build"] == {"invalid_build_responses": 0}
  assert result["n"] == 2 and result["failures"] == 0
  records = read_jsonl(tmp_path / "eval" / "predictions.jsonl")
  assert all(isinstance(r["prediction"], str) for r in records)
  assert {r["score"] for r in records} <= {0.0, 1.0}
  for record in records:
    bank = MemoryBank.load(str(tmp_path / "eval" / "banks" / "policy" /
                               record["dialogue_id"]))
    assert bank.step == 2  # One applied response per session.
    assert bank.core  # Every valid response has exactly one CORE line.
