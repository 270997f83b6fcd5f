"""Listing 5 through a chat model, and the counted newest-lines fallback."""

import collections
import json

import pytest

from cmimem_jax.client import CallResult
from cmimem_jax.config import memory_defaults
from cmimem_jax.data import Session, Turn
from cmimem_jax.encoders import HashingEncoder
from cmimem_jax.memory import MemoryBank, parse
from cmimem_jax.memory.apply import CoreConfig, apply_operations
from cmimem_jax.memory.compression import ChatCompressor, core_compressor
from cmimem_jax.memory.types import Action, MemoryType, Operation
from cmimem_jax.task.episode import apply_to_copy

ENCODER = HashingEncoder(64)
CONFIG = CoreConfig(cap_chars=200, compress_trigger=0.9,
                    compress_target_chars=120)
IDENTITY = "Name: Ana Souza, nurse in Oslo"


class ScriptedChat:
  """A `ChatModel` answering every prompt with `reply`; keeps the prompts."""

  def __init__(self, reply: CallResult):
    self.reply, self.prompts = reply, []

  def chat_many(self, conversations):
    self.prompts += [c[0]["content"] for c in conversations]
    return [self.reply for _ in conversations]


def _over_the_cap(compressor):
  bank = MemoryBank("u", ENCODER.dim)
  bank.core = IDENTITY + "\n" + "\n".join(f"Likes hobby number {i}"
                                          for i in range(7))
  return apply_operations(bank, [Operation(
      MemoryType.CORE, Action.APPEND, ("Started running in May 2024",))],
      ENCODER, session_index=3, core_config=CONFIG, compressor=compressor)


def test_the_model_compresses_the_core_with_listing_5():
  summary = IDENTITY + "; hobbies 0-6; runs since May 2024"
  model = ScriptedChat(CallResult(json.dumps({"content": summary})))
  compressor = ChatCompressor(model, CONFIG)
  bank, report = _over_the_cap(compressor)
  assert bank.core == summary  # Identity facts survive.
  assert report.compressed and not report.truncated
  assert report.compression_failures == 0 and compressor.calls == 1
  (prompt,) = model.prompts
  assert "limit: 200" in prompt and "Started running in May 2024" in prompt


@pytest.mark.parametrize("reply", [
    CallResult(None, "http_5xx"), CallResult("I cannot do that"),
    CallResult('{"content": ""}'), CallResult(json.dumps({"content": "x" * 300}))])
def test_failed_compressions_fall_back_to_the_newest_lines_and_count(reply):
  bank, report = _over_the_cap(ChatCompressor(ScriptedChat(reply), CONFIG))
  assert report.compressed and report.truncated
  assert IDENTITY not in bank.core  # What truncation costs.
  assert bank.core.endswith("Started running in May 2024")
  assert len(bank.core) <= CONFIG.compress_target_chars
  # An over-cap answer is flagged, not raised; the others raised.
  assert report.compression_failures == (0 if reply.text and "x" * 300 in
                                         reply.text else 1)


def test_training_counts_compressions_of_rollouts():
  memory = memory_defaults()
  memory.update({"core_cap_chars": 200, "compress_target_chars": 120,
                 "compressor": "policy"})
  model = ScriptedChat(CallResult("not json"))
  compressor = core_compressor(memory, {"policy": model, "answer": None})
  bank, _ = _over_the_cap(None)
  bank.core = IDENTITY + "\n" + "y" * 150
  session = Session("s", 0, None, "", (Turn("t1", "user", "user", "hi"),))
  stats = collections.Counter()
  apply_to_copy(bank, session, parse(
      "CORE:APPEND|Runs\nEPISODIC:SKIP\nSEMANTIC:SKIP\nPROCEDURAL:SKIP"),
      ENCODER, memory, compressor, stats)
  assert stats == {"core_compressions": 1, "core_compression_failures": 1,
                   "core_truncations": 1}
  with pytest.raises(ValueError, match="no answer model"):
    core_compressor(_with(memory, compressor="answer"), {"policy": model})
  assert core_compressor(_with(memory, compressor="none"), {}) is None


def _with(memory, **changes):
  copy = memory.copy_and_resolve_references()
  copy.update(changes)
  return copy
