"""Alg. 1's outer loop: run a memory policy over a dialogue, session by
session, applying each response to the bank."""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

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


def core_config(memory: Any) -> CoreConfig:
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
               memory: Any, on_step: Callable[[BuildStep], None] | None = None,
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
