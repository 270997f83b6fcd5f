"""`Apply` (paper Eq. 3, Table 10; SPEC §3.2): operations -> next memory state.

| type | action | effect |
| core | APPEND | add a line |
| core | REPLACE | first exact occurrence of old -> new; none = no-op, flagged |
| core | REWRITE | replace the block (cut to the cap) |
| episodic | ADD / UPDATE / MERGE | new entry (UPDATE/MERGE link to the olds, which stay) |
| semantic, procedural | ADD | new entry |
| semantic, procedural | UPDATE | replace the match in place (exact, else cosine >= 0.9); none = ADD, flagged |
| any entry type | SKIP | nothing |

All-or-nothing: operations are validated first and applied to a copy; the
input bank is never mutated.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence

import numpy as np

from cmimem_jax.encoders.base import Encoder
from cmimem_jax.memory.bank import MemoryBank, embed_texts
from cmimem_jax.memory.dsl import ParsedResponse
from cmimem_jax.memory.types import (Action, MemoryEntry, MemoryType,
                                     Operation, validate_operation)



@dataclasses.dataclass(frozen=True)
class MemoryEditors:
  """Model-backed rewrites `Apply` may call; None = the counted fallback.

  Attributes:
    compress_core: Listing 5: an over-trigger core block -> a shorter one
      (fallback: keep the newest lines that fit the target).
    summarize_merge: Listing 9: `(agent type, [old texts..., the policy's
      draft])` -> one merged text (fallback: the policy's draft).
  """
  compress_core: Callable[[str], str] | None = None
  summarize_merge: Callable[[str, Sequence[str]], str] | None = None


@dataclasses.dataclass(frozen=True)
class CoreConfig:
  """Core block limits (Table 6, Listing 5)."""
  cap_chars: int = 5000
  compress_trigger: float = 0.9  # Compress when usage exceeds this fraction.
  compress_target_chars: int = 3000


@dataclasses.dataclass
class ApplyReport:
  """What applying a response did.

  Attributes:
    applied: False when the response was rejected (the bank is unchanged).
    errors: Why it was rejected.
    flags: Per-operation notes on soft failures that still applied
      (REPLACE with no occurrence, UPDATE without a match, compression).
    entry_ids: For each input operation, the id of the entry it created or
      rewrote (None for core operations and SKIP).
    compressed: Whether the core block was compressed.
    compression_failures: Compression calls that raised (fell back to
      keeping the most recent lines).
    truncated: The core kept only its newest lines (no compressor, or it
      failed): older core facts were dropped.
    merges_summarized: MERGE texts written by `summarize_merge`.
    merge_summary_failures: `summarize_merge` calls that raised or
      returned nothing (the policy's draft was kept).
  """
  applied: bool = True
  errors: list[str] = dataclasses.field(default_factory=list)
  flags: list[str] = dataclasses.field(default_factory=list)
  entry_ids: list[str | None] = dataclasses.field(default_factory=list)
  compressed: bool = False
  compression_failures: int = 0
  truncated: bool = False
  merges_summarized: int = 0
  merge_summary_failures: int = 0


def keep_recent_lines(text: str, limit: int) -> str:
  """Fallback compression: the most recent whole lines that fit `limit`."""
  kept: list[str] = []
  size = -1  # Length of "\n".join(kept).
  for line in reversed(text.splitlines()):
    if size + 1 + len(line) > limit:
      break
    kept.append(line)
    size += 1 + len(line)
  if not kept:  # A single line longer than the limit: keep its tail.
    return text[-limit:]
  return "\n".join(reversed(kept))


def _compress_core(core: str, config: CoreConfig,
                   compressor: Callable[[str], str] | None,
                   report: ApplyReport) -> str:
  if len(core) <= config.compress_trigger * config.cap_chars:
    return core
  report.compressed = True
  if compressor is not None:
    try:
      compressed = compressor(core)
      if len(compressed) <= config.cap_chars:
        return compressed
      report.flags.append(f"core compressor returned {len(compressed)} chars "
                          f"(> {config.cap_chars}); keeping recent lines")
    except Exception as e:  # A remote LLM can fail in many ways.
      report.compression_failures += 1
      logging.warning("core compression failed (%s); keeping recent lines", e)
      report.flags.append(f"core compression failed: {e}")
  report.truncated = True
  return keep_recent_lines(core, config.compress_target_chars)


def _apply_core(bank: MemoryBank, op: Operation, config: CoreConfig,
                report: ApplyReport) -> None:
  if op.action is Action.APPEND:
    bank.core = f"{bank.core}\n{op.new_text}" if bank.core else op.new_text
  elif op.action is Action.REPLACE:
    old, new = op.fields
    if old in bank.core:
      bank.core = bank.core.replace(old, new, 1)
    else:
      report.flags.append(f"core REPLACE: {old[:60]!r} not found (no-op)")
  else:  # REWRITE
    bank.core = op.new_text[:config.cap_chars]


def _match(bank: MemoryBank, memory_type: MemoryType, text: str,
           vector: np.ndarray, threshold: float) -> int | None:
  """Exact text match, else the best cosine match >= threshold."""
  store = bank.stores[memory_type]
  position = store.find_exact(text)
  if position is not None:
    return position
  scores, positions = store.search(vector[None], 1)
  if positions.shape[1] and scores[0, 0] >= threshold:
    return int(positions[0, 0])
  return None


def apply_operations(bank: MemoryBank, operations: Sequence[Operation],
                     encoder: Encoder, *, session_index: int,
                     turn_ids: Sequence[str] = (),
                     core_config: CoreConfig = CoreConfig(),
                     editors: MemoryEditors = MemoryEditors(),
                     update_match_threshold: float = 0.9
                     ) -> tuple[MemoryBank, ApplyReport]:
  """Applies operations to a copy of `bank`.

  Args:
    bank: The state `M_{t-1}`; never modified.
    operations: In response order; each must pass `validate_operation`.
    encoder: Embeds new entries (and olds, for matching).
    session_index: Source session of the new entries (provenance).
    turn_ids: Source turns of the session; an operation's own `turn_ids`
      take precedence.
    core_config: Core cap and compression policy.
    editors: LLM-backed core compression (Listing 5) and MERGE summaries
      (Listing 9); without them the core keeps its most recent lines that
      fit the target and a MERGE keeps the policy's text.
    update_match_threshold: Cosine needed to match a non-verbatim `old`.

  Returns:
    `(M_t, report)`. If any operation is malformed, `(bank, report)` with
    `report.applied == False` and the reasons in `report.errors`.
  """
  report = ApplyReport()
  for i, op in enumerate(operations):
    error = validate_operation(op)
    if error:
      report.errors.append(f"operation {i}: {error}")
  if report.errors:
    report.applied = False
    return bank, report

  # One encoder call for every text this response needs.
  texts = [t for op in operations if op.memory_type is not MemoryType.CORE
           for t in op.fields if op.writes]
  vectors = iter(embed_texts(encoder, texts))

  new_bank = bank.copy()
  new_bank.step = step = bank.step + 1
  for op in operations:
    entry_id = None
    if op.memory_type is MemoryType.CORE:
      _apply_core(new_bank, op, core_config, report)
      new_bank.core = _compress_core(new_bank.core, core_config,
                                     editors.compress_core, report)
    elif op.writes:
      old_vectors = [next(vectors) for _ in op.old_texts]
      new_vector = next(vectors)
      entry_id = _apply_entry_op(new_bank, op, old_vectors, new_vector,
                                 step=step, session_index=session_index,
                                 turn_ids=tuple(op.turn_ids or turn_ids),
                                 threshold=update_match_threshold,
                                 report=report, encoder=encoder,
                                 summarize_merge=editors.summarize_merge)
    report.entry_ids.append(entry_id)
  return new_bank, report


def _summarize_merge(op: Operation, olds: list[str], draft_vector: np.ndarray,
                     encoder: Encoder,
                     summarize: Callable[[str, Sequence[str]], str],
                     report: ApplyReport) -> tuple[str, np.ndarray]:
  """Listing 9 over the merged memories and the policy's draft: the text
  and vector to store; a failure keeps the draft and is counted."""
  try:
    merged = summarize(op.memory_type.value, [*olds, op.new_text]).strip()
    if not merged:
      raise ValueError("empty merge summary")
  except Exception as e:  # A remote LLM can fail in many ways.
    report.merge_summary_failures += 1
    logging.warning("MERGE summary failed (%s); keeping the policy's text", e)
    report.flags.append(f"MERGE summary failed: {e}")
    return op.new_text, draft_vector
  report.merges_summarized += 1
  return merged, embed_texts(encoder, [merged])[0]


def _apply_entry_op(bank: MemoryBank, op: Operation,
                    old_vectors: list[np.ndarray], new_vector: np.ndarray, *,
                    step: int, session_index: int, turn_ids: tuple[str, ...],
                    threshold: float, report: ApplyReport, encoder: Encoder,
                    summarize_merge: Callable[[str, Sequence[str]], str] | None
                    ) -> str:
  store = bank.stores[op.memory_type]
  name = f"{op.memory_type.dsl_name}:{op.action.value}"
  matches = [_match(bank, op.memory_type, old, vec, threshold)
             for old, vec in zip(op.old_texts, old_vectors)]
  for old, position in zip(op.old_texts, matches):
    if position is None:
      report.flags.append(f"{name}: no memory matches {old[:60]!r}")
  linked = tuple(store.entries[p].entry_id for p in matches if p is not None)
  text = op.new_text
  if op.action is Action.MERGE and summarize_merge is not None:
    # The merged memories as stored (the policy may quote them loosely).
    olds = [old if p is None else store.entries[p].text
            for old, p in zip(op.old_texts, matches)]
    text, new_vector = _summarize_merge(op, olds, new_vector, encoder,
                                        summarize_merge, report)

  in_place = (op.action is Action.UPDATE
              and op.memory_type is not MemoryType.EPISODIC
              and matches[0] is not None)
  if in_place:
    previous = store.entries[matches[0]]
    store.replace(matches[0], dataclasses.replace(
        previous, text=text, updated_step=step,
        turn_ids=tuple(dict.fromkeys(previous.turn_ids + turn_ids))),
        new_vector)
    return previous.entry_id
  entry = MemoryEntry(
      entry_id=bank.new_entry_id(), memory_type=op.memory_type,
      text=text, created_step=step, updated_step=step,
      session_index=session_index, turn_ids=turn_ids,
      # Semantic/procedural UPDATE without a match degrades to ADD.
      links=linked if op.memory_type is MemoryType.EPISODIC else ())
  store.add(entry, new_vector)
  return entry.entry_id


def apply_response(bank: MemoryBank, response: ParsedResponse,
                   encoder: Encoder, **kwargs) -> tuple[MemoryBank, ApplyReport]:
  """Applies a parsed DSL response only if it is valid as a whole.

  An invalid response (Listing 6 rules) leaves the bank unchanged and the
  report lists the parse errors. Keyword arguments go to
  `apply_operations`.
  """
  if not response.valid:
    return bank, ApplyReport(applied=False,
                             errors=[str(e) for e in response.errors])
  return apply_operations(bank, response.operations, encoder, **kwargs)
