"""Scores a memory method on LongMemEval, LoCoMo or MemoryAgentBench (the
body of `python -m cmimem_jax.evaluate`).

Per dialogue: build the method's context provider (utterance RAG, or a
memory bank built by the policy / the JSON agents, cached under
`DIR/banks/`), retrieve a context for every question (Alg. 2), answer it
(unless the judge is `context_recall`, which needs no answer), judge, and
append one JSON record per question to `DIR/predictions.jsonl`, in
question order, flushed as soon as it and every question before it are
scored. Every question's answer call is sent as soon as its context is
ready (the endpoint's pool holds it until one of its `concurrency` slots
is free), each judged as soon as it is answered, while the next
dialogues' banks are built. A rerun skips questions already scored (failed judgements are retried) and
repairs a torn last line; `DIR/settings.json` records what decides the
results (`result_settings`) once the models are loaded (a run stopped
before then, e.g. by a missing checkpoint, leaves the workdir free for the
corrected command), and a rerun with other settings is refused.
`DIR/results.json` holds overall / per-category / task-averaged scores,
`n`, `failures` (judgements that could not be made, never scored) and
`missing` (questions whose dialogue's memory could not be built: a failed
builder call leaves no bank, cached or scored; a rerun builds it).
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import json
import dataclasses
import os
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import ml_collections
from absl import logging
from tqdm import tqdm

from cmimem_jax import storage
from cmimem_jax.client import ChatModel, EndpointConfig, OpenAIClient
from cmimem_jax.config import (Section, Sections, need,
                               positive_int, validate_config)
from cmimem_jax.data import (DatasetConfig, Dialogue, Question, WorkdirLock,
                             configured_split, load_configured, path_under,
                             read_jsonl)
from cmimem_jax.data.files import write_json
from cmimem_jax.encoders import Encoder, EncoderConfig, make_encoder
from cmimem_jax.evaluation.answering import (JudgedAnswer, MemoryContext,
                                             QAContext, TurnRAG,
                                             answer_and_judge)
from cmimem_jax.evaluation.builders import (CallFailed, agents_responder,
                                            policy_responder)
from cmimem_jax.evaluation.judges import LLMJudge, context_recall
from cmimem_jax.evaluation.memoryagentbench import (
    recommendation_recall_at_5, table2_scores, table17_column)
from cmimem_jax.evaluation.metrics import (aggregate, best_over_golds,
                                           locomo_f1, recall_at_k,
                                           rouge_l_f1, substring_exact_match,
                                           token_f1)
from cmimem_jax.memory.apply import MemoryEditors
from cmimem_jax.memory.bank import MemoryBank
from cmimem_jax.memory.builder import MemoryConfig, build_bank
from cmimem_jax.memory.compression import memory_editors
from cmimem_jax.memory.dsl import response_regex


METHODS = ("rag", "prompting", "policy")
JUDGES = ("context_recall", "llm")
MODEL_KINDS = ("none", "endpoint", "local")


@dataclasses.dataclass(frozen=True)
class EvaluationConfig(Section):
  """The evaluation job's top-level fields."""

  method: str     # One of METHODS: who builds the memory (or utterance RAG).
  limit: int      # The first N questions (0: all).
  rag_top_k: int  # Turns retrieved per question by the `rag` method.

  def invalid(self) -> Iterator[str]:
    yield from need(self, "method", lambda v: v in METHODS,
                    f"one of {METHODS}")
    yield from need(self, "limit", lambda v: v >= 0, "an int >= 0")
    yield from need(self, "rag_top_k", positive_int, "a positive integer")


@dataclasses.dataclass(frozen=True)
class JudgeConfig(Section):
  """The `judge` section: how an answer is scored."""

  SECTION: ClassVar[str] = "judge"

  kind: str                 # One of JUDGES.
  prompt: str               # listing11 | longmemeval (the llm judge's).
  endpoint: EndpointConfig  # The llm judge's model.

  def invalid(self) -> Iterator[str]:
    yield from need(self, "kind", lambda v: v in JUDGES, f"one of {JUDGES}")
    yield from need(self, "prompt", lambda v: v in ("listing11",
                                                    "longmemeval"),
                    "listing11 or longmemeval")

  def invalid_with(self, sections: Sections) -> Iterator[str]:
    answer = sections.get(AnswerModelConfig)
    if self.kind == "llm" and answer is not None and answer.kind == "none":
      yield ("judge.kind=llm needs an answer model: set answer.kind to "
             "endpoint or local")


@dataclasses.dataclass(frozen=True)
class ChatModelConfig(Section):
  """A chat model of an evaluation (`make_chat_model`): an endpoint, our
  Flax policy ("local": `path` a GGUF file or an HF folder, "" = the
  embedded SmolLM2; `init_checkpoint` a train / sft workdir whose step
  `checkpoint_step`, 0 = the newest, replaces the weights), or "none"."""

  KINDS: ClassVar[tuple[str, ...]] = MODEL_KINDS

  kind: str
  endpoint: EndpointConfig
  path: str = ""
  init_checkpoint: str = ""
  checkpoint_step: int = 0
  max_new_tokens: int = 256
  constrained_dsl: bool = False  # A local builder decodes valid DSL only.

  def invalid(self) -> Iterator[str]:
    yield from need(self, "kind", lambda v: v in self.KINDS,
                    " or ".join(self.KINDS))
    yield from need(self, "checkpoint_step", lambda v: v >= 0,
                    "an int >= 0 (0: the newest checkpoint of "
                    "init_checkpoint)")
    yield from need(self, "max_new_tokens", positive_int,
                    "a positive integer")


@dataclasses.dataclass(frozen=True)
class AnswerModelConfig(ChatModelConfig):
  """The `answer` section: who answers the questions (llm judge)."""

  SECTION: ClassVar[str] = "answer"


@dataclasses.dataclass(frozen=True)
class BuilderModelConfig(ChatModelConfig):
  """The `builder` section: who builds memories (`policy`, `prompting`)."""

  SECTION: ClassVar[str] = "builder"
  KINDS: ClassVar[tuple[str, ...]] = MODEL_KINDS[1:]


# What `evaluate` reads.
EVALUATION_SECTIONS = (EvaluationConfig, DatasetConfig, EncoderConfig,
                       MemoryConfig, JudgeConfig, AnswerModelConfig,
                       BuilderModelConfig)


def make_chat_model(section: ChatModelConfig,
                    constraint_regex: str | None = None) -> ChatModel:
  """An answer/builder model from its config section; a local model
  decodes matches of `constraint_regex` only, when given."""
  if section.kind == "endpoint":
    return OpenAIClient(section.endpoint)
  # The Flax model pulls in the model stack: import only when asked.
  from cmimem_jax.models.qwen3 import load_gguf, load_hf
  from cmimem_jax.models.qwen3.params import smollm2_gguf_path
  from cmimem_jax.rl import load_model_weights
  from cmimem_jax.sampling import (ChatPolicy, TokenConstraint,
                                   check_vocabulary,
                                   checkpoint_tokenizer_path, load_tokenizer)
  path = storage.require_local(section.path, "path") or smollm2_gguf_path()
  # The checkpoint's own tokenizer, as training reads it.
  tokenizer = load_tokenizer(checkpoint_tokenizer_path(path))
  model = load_hf(path) if os.path.isdir(path) else load_gguf(path)
  check_vocabulary(tokenizer, model.config.vocab_size, path)
  if section.init_checkpoint:  # E.g. a `train` or `sft` workdir.
    load_model_weights(model, section.init_checkpoint,
                       section.checkpoint_step)
  constraint = (None if constraint_regex is None else
                TokenConstraint.from_regex(constraint_regex, tokenizer))
  return ChatPolicy.jax(
      model, tokenizer,
      model.config.max_position_embeddings - section.max_new_tokens,
      constraint=constraint, max_new_tokens=section.max_new_tokens,
      prompt_limit_name="the local model's context less its max_new_tokens")


def context_provider(dialogue: Dialogue, encoder: Encoder,
                     run: EvaluationConfig, memory: MemoryConfig,
                     workdir: str, builder: ChatModel | None,
                     failures: collections.Counter,
                     editors: MemoryEditors = MemoryEditors()):
  """Where a question's context comes from: utterance RAG, or the memory
  the `run.method` builds for `dialogue` (cached in `workdir/banks`)."""
  if run.method == "rag":
    return TurnRAG(dialogue, encoder, run.rag_top_k)
  directory = path_under(workdir, "banks", run.method, dialogue.dialogue_id)
  if storage.path(storage.join(directory, "CURRENT")).exists():
    bank = MemoryBank.load(directory)
  else:
    make = {"policy": policy_responder, "prompting": agents_responder}
    # A failed builder call raises `CallFailed`: a bank missing a session
    # is never cached, nor are questions scored on it.
    respond = make[run.method](builder, encoder, memory.build_top_k,
                               failures=failures, raise_on_failure=True)
    bank, stats, _ = build_bank(dialogue, encoder, respond, memory,
                                editors=editors)
    logging.info("%s: built %d entries %s", dialogue.dialogue_id, len(bank),
                 stats)
    failures["invalid_build_responses"] += stats.get("invalid_responses", 0)
    for key in ("core_compression_failures", "core_truncations",
                "merge_summary_failures"):
      if stats.get(key):  # Listed only when it happened.
        failures[key] += stats[key]
    bank.save(directory)
  return MemoryContext(bank, dialogue, encoder, memory.qa_top_k,
                       memory.qa_chunk_budget)


def text_metrics(dataset: str, question: Question, prediction: str
                 ) -> dict[str, float]:
  """The benchmark's own string metrics for an answer."""
  golds = question.all_answers or (question.answer,)
  if dataset == "locomo":
    return {"f1": locomo_f1(prediction, question.answer, question.category)}
  if dataset == "memoryagentbench":
    metrics = {
        "substring_exact_match": best_over_golds(substring_exact_match,
                                                 prediction, golds),
        "f1": best_over_golds(token_f1, prediction, golds),
        "rouge_l_f1": best_over_golds(rouge_l_f1, prediction, golds)}
    if (table17_column(question.category) or ("", ""))[1] == "recall_at_5":
      metrics["recall_at_5"] = recommendation_recall_at_5(prediction, golds)
    return metrics
  return {}


def question_record(dataset: str, judge_kind: str, dialogue: Dialogue,
                    question: Question, context: QAContext,
                    outcome: JudgedAnswer | None) -> dict:
  """A question's `predictions.jsonl` record from its context and, when
  it was asked, its answer (and verdict)."""
  prediction = outcome and outcome.answer.text
  recall = context_recall(question, context.context)
  if judge_kind == "llm":
    score, judge_note = (outcome.verdict if outcome.verdict is not None
                         else (None, f"no answer: {outcome.answer.error}"))
  else:
    score, judge_note = recall, ""
  record = {
      "question_id": question.question_id,
      "dialogue_id": dialogue.dialogue_id, "category": question.category,
      "question": question.question, "gold": question.answer,
      "prediction": prediction, "score": score,
      "context_recall": recall,
      "retrieved": list(context.retrieved),
      # What the answer model reads: with LookupChunk, source turns too.
      "context_chars": len(context.context)}
  if recall is None and judge_kind == "context_recall":
    record["unscorable"] = "unanswerable question: no gold to find"
  elif score is None:
    record["error"] = judge_note
  if question.evidence:
    record["evidence_recall"] = recall_at_k(
        list(context.turns), question.evidence, len(context.turns) or 1)
  if prediction is not None:
    record.update(text_metrics(dataset, question, prediction))
  return record


def submit_dialogue(dialogue: Dialogue, questions: list[Question], provider,
                    answerer: ChatModel | None,
                    judge: LLMJudge | None
                    ) -> list[tuple[Question, QAContext, concurrent.futures.
                                    Future[JudgedAnswer] | None]]:
  """Every question's context, and its answer (and judge) calls sent
  (`answer_and_judge`; none without an answer model): returns at once for
  an endpoint, after the answers for a local model."""
  contexts: list[QAContext] = provider.many(questions)
  outcomes = (answer_and_judge(answerer, judge, questions, contexts)
              if answerer is not None else [None] * len(questions))
  return list(zip(questions, contexts, outcomes))


def read_records(path: str) -> dict[str, dict]:
  """Last record per question id (reruns append); a torn last line (a
  killed run) is dropped and cut from the file."""
  return {r["question_id"]: r for r in read_jsonl(path)}


def file_sha256(path: str) -> str:
  """The SHA-256 of a file's bytes (read in 1 MiB blocks)."""
  digest = hashlib.sha256()
  with storage.path(path).open("rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      digest.update(block)
  return digest.hexdigest()


def result_settings(sections: Sections) -> dict[str, Any]:
  """What decides a question's record and the cached banks: the dataset,
  method, encoder, memory settings and the models that build, answer and
  judge (not the subset, concurrency or timeouts), from the evaluation's
  validated `sections` (`EVALUATION_SECTIONS`). For the same config the
  JSON is the same as before the sections were typed (the encoder and
  memory sections as their config held them: `Section.as_config_dict`),
  so a workdir's `settings.json` still matches."""
  def model(section: ChatModelConfig, used: bool) -> dict[str, Any] | None:
    if not used or section.kind == "none":
      return None
    if section.kind == "endpoint":
      return {"kind": "endpoint", "model": section.endpoint.model,
              "temperature": section.endpoint.temperature,
              "max_tokens": section.endpoint.max_tokens}
    return {"kind": "local", "path": section.path,
            "init_checkpoint": section.init_checkpoint,
            "checkpoint_step": section.checkpoint_step,
            "max_new_tokens": section.max_new_tokens,
            "constrained_dsl": section.constrained_dsl}
  dataset, run = sections[DatasetConfig], sections[EvaluationConfig]
  judge = sections[JudgeConfig]
  llm_judge = judge.kind == "llm"
  settings = {
      "dataset": dataset.name,
      "dataset_file": os.path.basename(dataset.path),
      # The content, not the name: another file of the same name (other
      # evidence, other answers) must not reuse these records.
      "dataset_sha256": file_sha256(dataset.path),
      "split": configured_split(dataset, "evaluate"),
      "method": run.method,
      "rag_top_k": run.rag_top_k if run.method == "rag" else None,
      "encoder": sections[EncoderConfig].as_config_dict(),
      "memory": sections[MemoryConfig].as_config_dict(),
      "judge": {"kind": judge.kind, "prompt": judge.prompt,
                "model": judge.endpoint.model if llm_judge else None},
      "answer": model(sections[AnswerModelConfig], llm_judge),
      "builder": model(sections[BuilderModelConfig], run.method != "rag")}
  return json.loads(json.dumps(settings))  # Tuples as lists, as stored.


SETTINGS_FILE = "settings.json"


def check_settings(workdir: str, settings: dict[str, Any]) -> None:
  """Refuses a workdir whose results came from other settings (its
  `settings.json`, written by `record_settings`).

  Raises:
    ValueError: naming each setting that differs.
  """
  path = storage.path(storage.join(workdir, SETTINGS_FILE))
  if not path.exists():
    return
  stored = json.loads(path.read_text())
  changed = [f"{k}: {stored.get(k)!r} -> {settings.get(k)!r}"
             for k in sorted(set(stored) | set(settings))
             if stored.get(k) != settings.get(k)]
  if changed:
    raise ValueError(
        f"{workdir} holds results of other settings ({'; '.join(changed)})"
        ": use a new --workdir, or delete its predictions.jsonl, banks/ "
        "and settings.json")


def record_settings(workdir: str, settings: dict[str, Any]) -> None:
  """Writes `workdir/settings.json` (once: `check_settings` has refused
  other settings), when the run's inputs have been validated and before
  any result is written."""
  path = storage.join(workdir, SETTINGS_FILE)
  if not storage.path(path).exists():
    write_json(path, settings)


def questions_per_submit(model: ChatModel | None) -> int | None:
  """Questions sent to the answer model at once: all of a dialogue's for
  an endpoint (its pool bounds them) or none needed; a local model's
  batch (so records are written batch by batch)."""
  if model is None or isinstance(model, OpenAIClient):
    return None
  return getattr(model, "batch_size", 1)


def summarize(records: list[dict], sections: Sections, failures: dict
              ) -> dict:
  """`results.json`: the scores of `records` (overall, per category, per
  metric; LoCoMo's without the adversarial questions too; Table 2's for
  MemoryAgentBench) and the run's call `failures`, from the evaluation's
  `sections` (its dataset, method and judge)."""
  dataset = sections[DatasetConfig].name
  excluded = ("adversarial",) if dataset == "locomo" else ()
  summary = aggregate(records)
  result = {
      "dataset": dataset, "method": sections[EvaluationConfig].method,
      "judge": sections[JudgeConfig].kind, **summary}
  if excluded:
    result["without_adversarial"] = aggregate(
        records, exclude_from_overall=excluded)["overall"]
  for metric in ("f1", "evidence_recall", "context_recall",
                 "substring_exact_match", "rouge_l_f1", "recall_at_5"):
    scored = [r for r in records if r.get(metric) is not None]
    if scored:
      result[metric] = aggregate(scored, score_key=metric,
                                 exclude_from_overall=excluded)
  if dataset == "memoryagentbench":
    result["table2"] = table2_scores(records)
  result["call_failures"] = failures
  return result


def failed_endpoints(sections: Sections, result: dict) -> str:
  """The endpoints whose calls failed in a run's `result` ("answer URL,
  judge URL"), from the evaluation's `sections`, for the line that
  reports it."""
  roles = {"answer": sections[AnswerModelConfig],
           "builder": sections[BuilderModelConfig],
           "judge": sections[JudgeConfig]}
  failed = [f"{role} {section.endpoint.base_url}"
            for role, section in roles.items()
            if result["call_failures"].get(role, {}).get("failed_calls")]
  return ", ".join(failed) or "no endpoint call failed"


def evaluate(config: ml_collections.ConfigDict | Sections, workdir: str
             ) -> dict:
  """Runs (or resumes) an evaluation; returns what it writes to
  `results.json`.

  Args:
    config: the evaluation's config, or its sections validated already
      (`validate_config(config, EVALUATION_SECTIONS)`: the entry point's,
      which reads them again after the run).
    workdir: where predictions, banks, settings and results go.
  """
  sections = (config if isinstance(config, Sections) else
              validate_config(config, required=EVALUATION_SECTIONS))
  dataset, run = sections[DatasetConfig], sections[EvaluationConfig]
  memory, judge_config = sections[MemoryConfig], sections[JudgeConfig]
  answer_config = sections[AnswerModelConfig]
  builder_config = sections[BuilderModelConfig]
  WorkdirLock(workdir, "evaluate").acquire()
  dialogues = load_configured(dataset, "evaluate")
  dialogues = dialogues[dataset.start:]
  if dataset.dialogues:
    dialogues = dialogues[:dataset.dialogues]
  selected = [(d, q) for d in dialogues for q in d.questions]
  if run.limit:
    selected = selected[:run.limit]
  if not selected:
    raise ValueError(f"{dataset.path}: no questions to evaluate "
                     f"({len(dialogues)} dialogues from dataset.start="
                     f"{dataset.start}, split "
                     f"{configured_split(dataset, 'evaluate')!r})")
  ids = collections.Counter(q.question_id for _, q in selected)
  repeated = [qid for qid, count in ids.items() if count > 1]
  if repeated:
    raise ValueError(f"{len(repeated)} question ids occur more than once "
                     f"(records would merge), e.g. {repeated[:5]}")
  # Refused before any model loads; recorded once they have.
  settings = result_settings(sections)
  check_settings(workdir, settings)
  path = storage.join(workdir, "predictions.jsonl")
  # Scored and unscorable records are final; failed judgements are redone.
  done = {qid for qid, r in read_records(path).items()
          if r.get("score") is not None or r.get("unscorable")}
  pending: dict[str, list[Question]] = collections.defaultdict(list)
  for dialogue, question in selected:
    if question.question_id not in done:
      pending[dialogue.dialogue_id].append(question)
  encoder = make_encoder(sections[EncoderConfig])
  answerer = (None if judge_config.kind == "context_recall"
              or answer_config.kind == "none"
              else make_chat_model(answer_config))
  builder = None
  if run.method != "rag" and any(pending.values()):
    constrained = (run.method == "policy" and builder_config.kind == "local"
                   and builder_config.constrained_dsl)
    builder = make_chat_model(builder_config,
                              response_regex() if constrained else None)
  editors = (memory_editors(memory, {"policy": builder, "answer": answerer})
             if builder is not None else MemoryEditors())
  judge = None
  if judge_config.kind == "llm":
    judge = LLMJudge(OpenAIClient(judge_config.endpoint),
                     judge_config.prompt)
  record_settings(workdir, settings)
  failures: collections.Counter[str] = collections.Counter()
  per_submit = questions_per_submit(answerer)
  start = time.perf_counter()
  with storage.Appender(path) as out, tqdm(
      total=len(selected), initial=len(selected) - sum(
          len(v) for v in pending.values()), desc="questions",
      disable=None) as bar:
    # Questions whose calls are in flight, in order: each record is
    # written once it and those before it are scored.
    in_flight: collections.deque = collections.deque()

    def write_scored(wait: bool) -> None:
      while in_flight and (wait or in_flight[0][3] is None
                           or in_flight[0][3].done()):
        dialogue, question, context, outcome = in_flight.popleft()
        out.write(json.dumps(question_record(
            dataset.name, judge_config.kind, dialogue, question,
            context, outcome and outcome.result())) + "\n")
        out.flush()  # A crash loses at most the calls still in flight.
        bar.update(1)

    for dialogue in dialogues:
      questions = pending.get(dialogue.dialogue_id)
      if not questions:
        continue
      try:
        provider = context_provider(dialogue, encoder, run, memory, workdir,
                                    builder, failures, editors)
      except CallFailed as e:
        logging.warning("%s: no memory built, a builder call failed (%s): "
                        "its %d questions are left for a rerun",
                        dialogue.dialogue_id, e, len(questions))
        failures["unbuilt_dialogues"] += 1
        continue
      step = per_submit or len(questions)
      for first in range(0, len(questions), step):
        in_flight.extend((dialogue, *sent) for sent in submit_dialogue(
            dialogue, questions[first:first + step], provider, answerer,
            judge))
        write_scored(wait=False)
    write_scored(wait=True)
  wanted = {q.question_id for _, q in selected}
  records = [r for qid, r in read_records(path).items() if qid in wanted]
  calls = {name: model.failures.as_dict() for name, model in
           (("answer", answerer), ("builder", builder),
            ("judge", judge and judge.client)) if hasattr(model, "failures")}
  result = summarize(records, sections, {"build": dict(failures), **calls})
  # Questions without a record: their dialogue's memory could not be built.
  result["missing"] = len(wanted) - len(records)
  result["seconds"] = round(time.perf_counter() - start, 2)
  write_json(storage.join(workdir, "results.json"), result)
  return result
