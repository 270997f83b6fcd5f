"""Listings 5 and 9 through a chat model, and their counted fallbacks."""

import collections
import dataclasses
import json

import ml_collections
import numpy as np
import pytest

from cmimem_jax.client import CallResult
from cmimem_jax.config import ConfigError, memory_defaults, validate_config
from cmimem_jax.memory.builder import MemoryConfig
from cmimem_jax.data import Session, Turn
from cmimem_jax.encoders import HashingEncoder
from cmimem_jax.memory import MemoryBank, parse
from cmimem_jax.memory.apply import CoreConfig, MemoryEditors, apply_operations
from cmimem_jax.memory.builder import core_config
from cmimem_jax.memory.compression import (ChatCompressor,
                                           ChatMergeSummarizer, memory_editors)
from cmimem_jax.memory.types import Action, MemoryType, Operation
from cmimem_jax.sampling import ChatPolicy, load_tokenizer
from cmimem_jax.sampling.sampler import SampleOutput, left_pad
from cmimem_jax.task.episode import apply_to_copy
from cmimem_jax.testing.fake_openai import FakeOpenAI

ENCODER = HashingEncoder(64)
CONFIG = CoreConfig(cap_chars=200, compress_trigger=0.9,
                    compress_target_chars=120)
IDENTITY = "Name: Ana Souza, nurse in Oslo"


class ScriptedChat:
  """A `ChatModel` answering every prompt with `reply`; keeps the prompts."""

  def __init__(self, reply: CallResult):
    self.reply, self.prompts = reply, []

  def chat_many(self, conversations, max_tokens=None):
    self.prompts += [c[0]["content"] for c in conversations]
    self.max_tokens = max_tokens
    return [self.reply for _ in conversations]


def _over_the_cap(compressor):
  bank = MemoryBank("u", ENCODER.dim)
  bank.core = IDENTITY + "\n" + "\n".join(f"Likes hobby number {i}"
                                          for i in range(7))
  return apply_operations(bank, [Operation(
      MemoryType.CORE, Action.APPEND, ("Started running in May 2024",))],
      ENCODER, session_index=3, core_config=CONFIG,
      editors=MemoryEditors(compress_core=compressor))


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
  memory = _typed(_with(memory_defaults(), core_cap_chars=200,
                        compress_target_chars=120, compressor="policy"))
  model = ScriptedChat(CallResult("not json"))
  editors = memory_editors(memory, {"policy": model, "answer": None})
  assert editors.summarize_merge is None
  bank, _ = _over_the_cap(None)
  bank.core = IDENTITY + "\n" + "y" * 150
  session = Session("s", 0, None, "", (Turn("t1", "user", "user", "hi"),))
  stats = collections.Counter()
  apply_to_copy(bank, session, parse(
      "CORE:APPEND|Runs\nEPISODIC:SKIP\nSEMANTIC:SKIP\nPROCEDURAL:SKIP"),
      ENCODER, memory, editors, stats)
  assert stats == {"core_compressions": 1, "core_compression_failures": 1,
                   "core_truncations": 1}
  with pytest.raises(ValueError, match="no answer model"):
    memory_editors(dataclasses.replace(memory, compressor="answer"),
                   {"policy": model})
  assert memory_editors(dataclasses.replace(memory, compressor="none"),
                        {}) == MemoryEditors()


def _with(memory, **changes):
  """A copy of the `memory` config section with `changes`."""
  copy = memory.copy_and_resolve_references()
  copy.update(changes)
  return copy


def _typed(memory) -> MemoryConfig:
  """The `memory` config section as a job's `validate_config` builds it."""
  return MemoryConfig.from_config(memory)


OLDS = ("2024-03-15: Alex's first Italian cooking class with Marco",
        "2024-03-22: Alex's second cooking class, made fresh pasta")
DRAFT = "2024-03-15 to 2024-03-22: Alex's Italian cooking classes"
MERGE_RESPONSE = ("CORE:APPEND|Cooks\nEPISODIC:MERGE|" + "|".join(OLDS) + "|" + DRAFT
                  + "\nSEMANTIC:SKIP\nPROCEDURAL:SKIP")


def _episodic_bank():
  bank = MemoryBank("u", ENCODER.dim)
  bank, _ = apply_operations(bank, [
      Operation(MemoryType.EPISODIC, Action.ADD, (old,)) for old in OLDS],
      ENCODER, session_index=0)
  return bank


def test_merge_text_comes_from_listing_9():
  summary = ("2024-03-15 to 2024-03-22: two Italian cooking classes with "
             "Marco; Alex made fresh pasta in the second")
  model = ScriptedChat(CallResult(f"  {summary}\n"))
  merger = ChatMergeSummarizer(model)
  before = _episodic_bank()
  after, report = apply_operations(
      before, parse(MERGE_RESPONSE).operations, ENCODER, session_index=1,
      editors=MemoryEditors(summarize_merge=merger))
  merged = after.stores[MemoryType.EPISODIC].entries[-1]
  assert merged.text == summary and report.merges_summarized == 1
  assert merged.links == tuple(
      e.entry_id for e in before.stores[MemoryType.EPISODIC].entries)
  # The stored vector is the summary's, not the draft's.
  assert after.stores[MemoryType.EPISODIC].find_exact(summary) == 2
  (prompt,) = model.prompts
  assert prompt.startswith("You are a memory management assistant. Merge "
                           "the following episodic")
  assert prompt.endswith("Memories to merge:\n" + "\n".join(
      f"- {m}" for m in (*OLDS, DRAFT)))
  assert merger.calls == 1
  # ADD and UPDATE never reach the summariser.
  apply_operations(before, [Operation(MemoryType.EPISODIC, Action.UPDATE,
                                      (OLDS[0], "x"))], ENCODER,
                   session_index=1, editors=MemoryEditors(summarize_merge=merger))
  assert merger.calls == 1


@pytest.mark.parametrize("reply", [CallResult(None, "timeout"),
                                   CallResult("   ")])
def test_a_failed_merge_summary_keeps_the_policy_text_and_counts(reply):
  memory = _typed(_with(memory_defaults(), merge_summarizer="answer"))
  editors = memory_editors(memory, {"policy": None,
                                    "answer": ScriptedChat(reply)})
  stats = collections.Counter()
  session = Session("s", 1, None, "", (Turn("t1", "user", "user", "hi"),))
  after = apply_to_copy(_episodic_bank(), session, parse(MERGE_RESPONSE),
                        ENCODER, memory, editors, stats)
  assert after.stores[MemoryType.EPISODIC].entries[-1].text == DRAFT
  assert stats == {"merge_summary_failures": 1}


def _external(base_url, model="summarizer"):
  memory = _with(memory_defaults(), merge_summarizer="external")
  memory.summarizer_endpoint.update({"base_url": base_url, "model": model,
                                     "max_retries": 0})
  return memory


def test_an_external_endpoint_summarises_merges():
  """App. H.3's "external summarizer": `merge_summarizer="external"` asks
  `memory.summarizer_endpoint` with Listing 9, whatever the job's models."""
  summary = "2024-03-15 to 2024-03-22: two cooking classes with Marco"
  with FakeOpenAI(reply=lambda prompt: summary) as server:
    memory = _typed(_external(server.base_url))
    editors = memory_editors(memory, {"policy": None, "answer": None})
    session = Session("s", 1, None, "", (Turn("t1", "user", "user", "hi"),))
    stats = collections.Counter()
    after = apply_to_copy(_episodic_bank(), session, parse(MERGE_RESPONSE),
                          ENCODER, memory, editors, stats)
    assert server.requests == 1
  assert after.stores[MemoryType.EPISODIC].entries[-1].text == summary
  assert stats == {"merges_summarized": 1}
  assert editors.compress_core is None  # The compressor stays "none".


def test_the_external_summariser_is_validated():
  config = ml_collections.ConfigDict({"memory": _external("http://h/v1")})
  validate_config(config, required=(MemoryConfig,))
  for changes, message in (({"base_url": "h:8000"}, "base_url"),
                           ({"model": ""}, "summarizer_endpoint.model"),
                           ({"retries": 2}, "memory.summarizer_endpoint."
                                            "retries: unknown setting")):
    bad = ml_collections.ConfigDict({"memory": _external("http://h/v1")})
    bad.memory.summarizer_endpoint.update(changes)
    with pytest.raises(ConfigError, match=message):
      validate_config(bad, required=(MemoryConfig,))
  # Only MERGE has an external summariser (Listing 5 names none).
  bad = ml_collections.ConfigDict({"memory": _with(memory_defaults(),
                                                   compressor="external")})
  with pytest.raises(ConfigError, match="memory.compressor"):
    validate_config(bad, required=(MemoryConfig,))


class ScriptedEngine:
  """A `GenerationEngine` that writes `text`, cut at the call's token
  budget as a real engine cuts it."""

  def __init__(self, tokenizer, text):
    self.ids = tokenizer.encode(text, add_special_tokens=False)
    self.budgets = []

  def set_model(self, model):
    del model

  def generate(self, prompts, key, temperature, top_p, max_new_tokens,
               row_budgets=None, constrained=True):
    del key, temperature, top_p, row_budgets
    self.budgets.append((max_new_tokens, constrained))
    ids = self.ids[:max_new_tokens]
    tokens = np.tile(np.asarray(ids, np.int32), (len(prompts), 1))
    prompt, mask = left_pad(prompts, max(len(p) for p in prompts), 0)
    return SampleOutput(tokens, np.zeros(tokens.shape, np.float32),
                        np.full(len(prompts), len(ids)), prompt, mask)


def test_a_long_listing_5_answer_through_the_policy_is_not_cut():
  """The paper's core cap (5,000 chars, compressed to 3,000): a valid
  ~2,900-character Listing 5 answer through `ChatPolicy` (the training
  job's `memory.compressor = "policy"`) arrives whole, with the default
  budget; at the chat default of 256 tokens it was always cut."""
  tokenizer = load_tokenizer("")
  lines = [IDENTITY] + [f"Fact {i}: took a pottery class in week {i} and "
                        f"made a bowl for her sister" for i in range(45)]
  content = "\n".join(lines)[:2900].strip()
  engine = ScriptedEngine(tokenizer, json.dumps({"content": content}))
  policy = ChatPolicy(engine, tokenizer, max_prompt_tokens=4096)
  memory = _typed(_with(memory_defaults(), compressor="policy"))
  editors = memory_editors(memory, {"policy": policy, "answer": None})
  assert editors.compress_core(content + "\nmore") == content
  assert engine.budgets == [(memory.compress_max_tokens, False)]
  assert len(engine.ids) > 600  # Far past the old 256-token budget.
  with pytest.raises(ValueError):  # What 256 tokens gave.
    ChatCompressor(policy.free_text(), core_config(memory), 256)(content)
