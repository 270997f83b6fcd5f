"""Alg. 1's outer loop: run a memory policy over a dialogue, session by
session, applying each response to the bank."""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import ClassVar

from cmimem_jax.config import (MEMORY_EDITORS, EndpointConfig, Section, need,
                               positive_int)
from cmimem_jax.data.types import Dialogue, Session
from cmimem_jax.encoders.base import Encoder
from cmimem_jax.memory.apply import (ApplyReport, CoreConfig, MemoryEditors,
                                     apply_response)
from cmimem_jax.memory.bank import MemoryBank
from cmimem_jax.memory.dsl import ParsedResponse

# (bank M_{t-1}, session C_t) -> the policy's parsed response.
Responder = Callable[[MemoryBank, Session], ParsedResponse]


@dataclasses.dataclass
class BuildStep:
  """One session: the bank the response was applied to, and the response."""
  bank_before: MemoryBank
  session: Session
  response: ParsedResponse


@dataclasses.dataclass(frozen=True)
class MemoryConfig(Section):
  """The `memory` section (Table 6; `config.memory_defaults` has the
  values and what each means)."""

  SECTION: ClassVar[str] = "memory"

  core_cap_chars: int
  compress_trigger: float
  compress_target_chars: int
  build_top_k: int
  qa_top_k: int
  source_chunks: bool
  chunk_budget_chars: int
  update_match_threshold: float
  compressor: str
  merge_summarizer: str
  summarizer_endpoint: EndpointConfig
  compress_max_tokens: int
  merge_max_tokens: int

  def invalid(self) -> Iterator[str]:
    for key in ("core_cap_chars", "compress_target_chars", "build_top_k",
                "qa_top_k"):
      yield from need(self, key, positive_int, "a positive integer")
    for key in ("compress_max_tokens", "merge_max_tokens"):
      yield from need(self, key, positive_int, "a positive integer (tokens)")
    yield from need(self, "compress_trigger", lambda v: 0.0 < v <= 1.0,
                    "in (0, 1]")
    yield from need(self, "chunk_budget_chars", lambda v: v >= 0,
                    "a non-negative integer")
    yield from need(self, "compressor", lambda v: v in MEMORY_EDITORS,
                    f"one of {MEMORY_EDITORS}")
    merge_summarizers = MEMORY_EDITORS + ("external",)
    yield from need(self, "merge_summarizer",
                    lambda v: v in merge_summarizers,
                    f"one of {merge_summarizers}")
    if self.merge_summarizer == "external" and not (
        self.summarizer_endpoint.model):
      yield ("summarizer_endpoint.model='': must be a model name "
             "(memory.merge_summarizer='external' calls it)")
    yield from need(self, "update_match_threshold",
                    lambda v: -1.0 <= v <= 1.0, "in [-1, 1]")
    if self.compress_target_chars > self.core_cap_chars:
      yield ("compress_target_chars must not exceed memory.core_cap_chars "
             f"({self.compress_target_chars} > {self.core_cap_chars})")

  @property
  def qa_chunk_budget(self) -> int:
    """Characters of source turns `LookupChunk` may add to a QA context
    (0 when `source_chunks` is off)."""
    return self.chunk_budget_chars if self.source_chunks else 0


def core_config(memory: MemoryConfig) -> CoreConfig:
  """`CoreConfig` from a validated `memory` config section."""
  return CoreConfig(memory.core_cap_chars, memory.compress_trigger,
                    memory.compress_target_chars)


# The `ApplyReport` counters of model rewrites, as named in stats/metrics.
EDIT_COUNTERS = ("core_compressions", "core_compression_failures",
                 "core_truncations", "merges_summarized",
                 "merge_summary_failures")


def count_model_edits(stats: collections.Counter[str],
                      report: ApplyReport) -> None:
  """Adds what compressing the core and summarising MERGEs did to `stats`
  (zeros left out)."""
  for key, value in zip(EDIT_COUNTERS, (
      report.compressed, report.compression_failures, report.truncated,
      report.merges_summarized, report.merge_summary_failures)):
    if value:
      stats[key] += int(value)


def build_bank(dialogue: Dialogue, encoder: Encoder, respond: Responder,
               memory: MemoryConfig, on_step: Callable[[BuildStep], None] | None = None,
               editors: MemoryEditors = MemoryEditors()
               ) -> tuple[MemoryBank, dict[str, int], list[BuildStep]]:
  """Runs `respond` over every session of `dialogue` from an empty bank.

  Invalid responses leave the bank unchanged; they are counted
  (`invalid_responses`) and logged with their parse errors.

  Returns:
    The final bank, counters, and one `BuildStep` per session.
  """
  config = core_config(memory)
  bank = MemoryBank(dialogue.dialogue_id, encoder.dim)
  stats: collections.Counter[str] = collections.Counter()
  steps = []
  for session in dialogue.sessions:
    response = respond(bank, session)
    if not response.valid:
      stats["invalid_responses"] += 1
      logging.warning("%s: invalid response: %s", session.session_id,
                      [str(e) for e in response.errors])
    step = BuildStep(bank, session, response)
    steps.append(step)
    if on_step is not None:
      on_step(step)
    bank, report = apply_response(
        bank, response, encoder, session_index=session.index,
        turn_ids=tuple(t.turn_id for t in session.turns), core_config=config,
        editors=editors,
        update_match_threshold=memory.update_match_threshold)
    stats["operations"] += len(response.operations)
    stats["flags"] += len(report.flags)
    count_model_edits(stats, report)
  return bank, dict(stats), steps
