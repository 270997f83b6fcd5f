"""Builds memory banks session by session and shows what retrieval recovers
(the body of `python -m cmimem_jax.build_memory`).

For each conversation: every session's operations (from the configured
policy) are rendered as DSL, parsed, and applied (Alg. 1); each response is
scored with the CMI reward terms against the bank it was applied to (all
sessions in one batched kernel call; the QA term is 0 here: no judge); the
bank is saved to `DIR/<dialogue_id>/` and reloaded to check the round trip;
then, for every question, the top-k fragments and their source turns
(Alg. 2) are retrieved and the evidence-turn recall is reported per
category.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import time
from collections.abc import Callable, Iterator

import ml_collections
import numpy as np

from cmimem_jax import storage
from cmimem_jax.config import Section, Sections, need, validate_config
from cmimem_jax.data import (DatasetConfig, Dialogue, WorkdirLock,
                             load_configured, path_under)
from cmimem_jax.data.files import write_json
from cmimem_jax.encoders import Encoder, EncoderConfig, make_encoder
from cmimem_jax.memory import MemoryBank, lookup_chunks
from cmimem_jax.memory.annotations import locomo_annotation_operations
from cmimem_jax.memory.bank import embed_texts
from cmimem_jax.memory.builder import BuildStep, MemoryConfig, Responder
from cmimem_jax.memory.builder import build_bank as run_policy
from cmimem_jax.memory.dsl import ParsedResponse, rendered_response
from cmimem_jax.task.reward import RewardComputer, RewardConfig, RolloutInput
from cmimem_jax.task.skip_table import calibrated


def annotation_responder(dialogue: Dialogue) -> Responder:
  """The LoCoMo annotation policy as a responder (DSL render -> parse)."""
  def respond(bank: MemoryBank, session) -> ParsedResponse:
    del bank
    return rendered_response(locomo_annotation_operations(dialogue, session))
  return respond


# Responder factories by `BuildMemoryConfig.policy`.
POLICIES: dict[str, Callable[[Dialogue], Responder]] = {
    "annotations": annotation_responder}


@dataclasses.dataclass(frozen=True)
class BuildMemoryConfig(Section):
  """`build_memory`'s top-level fields."""

  policy: str          # Who builds the banks: one of POLICIES.
  show_questions: int  # Retrieval examples printed per conversation.

  def invalid(self) -> Iterator[str]:
    yield from need(self, "policy", lambda v: v in POLICIES,
                    f"one of {sorted(POLICIES)}")
    yield from need(self, "show_questions", lambda v: v >= 0,
                    "an int >= 0")

  def invalid_with(self, sections: Sections) -> Iterator[str]:
    memory = sections.get(MemoryConfig)
    for key in ("compressor", "merge_summarizer"):
      if memory is not None and getattr(memory, key) != "none":
        yield (f"memory.{key}={getattr(memory, key)!r}: build_memory runs "
               "no chat model; use 'none'")


# What `run` reads.
BUILD_MEMORY_SECTIONS = (BuildMemoryConfig, DatasetConfig, EncoderConfig,
                         MemoryConfig, RewardConfig)


def build_bank(dialogue: Dialogue, encoder: Encoder, policy: str,
               memory: MemoryConfig, verbose: bool = False
               ) -> tuple[MemoryBank, dict, list[RolloutInput]]:
  """Runs the `policy` (a key of POLICIES) over every session.

  Returns:
    The final bank, counters, and one `RolloutInput` per session (the
    response with the bank `M_{t-1}` it was applied to) for scoring.
  """
  def show(step: BuildStep) -> None:
    if verbose and step.session.index < 2:
      print(f"--- session {step.session.index + 1} "
            f"({step.session.date_text}) DSL:")
      print(step.response.text)

  bank, stats, steps = run_policy(dialogue, encoder,
                                  POLICIES[policy](dialogue), memory,
                                  on_step=show)
  rollouts = [RolloutInput(s.bank_before, s.session.format(), s.response,
                           user_turns=s.session.user_turns())
              for s in steps]
  return bank, stats, rollouts


def reward_summary(rollouts: list[RolloutInput], encoder: Encoder,
                   reward: RewardConfig, encoder_config: EncoderConfig
                   ) -> dict[str, float]:
  """Mean CMI reward terms over the sessions (one batched call), with the
  Semantic SKIP thresholds calibrated for `encoder_config`'s encoder."""
  terms = RewardComputer(encoder, calibrated(reward, encoder_config))(
      rollouts)
  rho = [op.rho_new for t in terms for op in t.operations]
  return {
      "mean_cmi": float(np.mean([t.cmi for t in terms])),
      "mean_rho_new": float(np.mean(rho)) if rho else 0.0,
      "scored_operations": len(rho),
      "mean_length_factor": float(np.mean([t.length_factor for t in terms])),
      "mean_cross_duplicate_fraction": float(np.mean(
          [t.cross_duplicate_fraction for t in terms])),
      "semantic_skips_justified": sum(
          bool(t.semantic_skip_justified) for t in terms),
  }


def evidence_recall(dialogue: Dialogue, bank: MemoryBank, encoder: Encoder,
                    memory: MemoryConfig, show: int = 0) -> dict[str, float]:
  """Mean fraction of each question's evidence turns found by Alg. 2 lookup."""
  by_category: dict[str, list[float]] = collections.defaultdict(list)
  # One encoder call for all questions (an encoder batch per question would
  # dominate the run time).
  queries = embed_texts(encoder, [q.question for q in dialogue.questions],
                        kind="query")
  for i, (question, query) in enumerate(zip(dialogue.questions, queries)):
    if not question.evidence:
      continue
    hits = bank.search(query, memory.qa_top_k)
    chunks = lookup_chunks(hits, dialogue, memory.qa_chunk_budget)
    found = {t.turn_id for c in chunks for t in c.turns}
    recall = sum(e in found for e in question.evidence) / len(question.evidence)
    by_category[question.category].append(recall)
    if i < show:
      print(f"Q: {question.question}  (gold: {question.answer})")
      for hit in hits[:3]:
        print(f"   {hit.score:.2f} [{hit.entry.memory_type.value}] "
              f"{hit.entry.text[:100]}")
      print(f"   evidence {list(question.evidence)} recall={recall:.2f}")
  return {c: sum(v) / len(v) for c, v in sorted(by_category.items())}


def run(config: ml_collections.ConfigDict, workdir: str | None
        ) -> dict[str, dict]:
  """Builds, scores, saves (under `workdir`, if given) and probes a bank per
  dialogue, printing each as it goes; returns the per-dialogue summary
  (also written to `workdir/summary.json`)."""
  sections = validate_config(config, required=BUILD_MEMORY_SECTIONS)
  job, dataset = sections[BuildMemoryConfig], sections[DatasetConfig]
  memory, encoder_config = sections[MemoryConfig], sections[EncoderConfig]
  if workdir:
    WorkdirLock(workdir, "build_memory").acquire()
  encoder = make_encoder(encoder_config)
  dialogues = load_configured(dataset, "build_memory")
  summary = {}
  for dialogue in dialogues[:dataset.dialogues]:
    start = time.perf_counter()
    bank, stats, rollouts = build_bank(dialogue, encoder, job.policy,
                                       memory, verbose=True)
    build_s = time.perf_counter() - start
    start = time.perf_counter()
    rewards = reward_summary(rollouts, encoder, sections[RewardConfig],
                             encoder_config)
    reward_s = time.perf_counter() - start
    print(bank.render(max_entries=5))
    if workdir:
      directory = path_under(workdir, dialogue.dialogue_id)
      bank.save(directory)
      if MemoryBank.load(directory) != bank:
        raise RuntimeError(f"reloaded bank in {directory} differs")
      print(f"saved and reloaded {directory}")
    recall = evidence_recall(dialogue, bank, encoder, memory,
                             show=job.show_questions)
    summary[dialogue.dialogue_id] = {
        "sessions": len(dialogue.sessions), "entries": len(bank),
        "core_chars": len(bank.core), "build_seconds": round(build_s, 3),
        "reward_seconds": round(reward_s, 3), **stats,
        "cmi_reward": {k: round(v, 4) if isinstance(v, float) else v
                       for k, v in rewards.items()},
        "evidence_recall": {k: round(v, 3) for k, v in recall.items()}}
    print(json.dumps({dialogue.dialogue_id: summary[dialogue.dialogue_id]}))
  if workdir:
    write_json(storage.join(workdir, "summary.json"), summary)
  return summary
