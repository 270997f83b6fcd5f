"""Memory-building methods for evaluation (SPEC §6): `policy` (our DSL
policy, Listings 6-7) and `prompting` (the four JSON agents, Listings 1-4,
with any chat model: Ours-P / MemBuilder-P). Chat failures are counted
and give an invalid response (the bank is left unchanged), never a guess.
"""

from __future__ import annotations

import collections

from cmimem_jax.data.types import Session
from cmimem_jax.encoders.base import Encoder
from cmimem_jax.client import ChatModel
from cmimem_jax.memory.bank import MemoryBank
from cmimem_jax.memory.builder import Responder
from cmimem_jax.memory.dsl import LineError, ParsedResponse, parse
from cmimem_jax.memory.json_agents import combine_agent_outputs
from cmimem_jax.memory.prompt_builder import (build_agent_prompt,
                                              build_policy_messages)
from cmimem_jax.memory.retrieval import retrieve_per_type
from cmimem_jax.memory.types import MemoryType


class CallFailed(RuntimeError):
  """A builder's chat call failed after its retries: the session has no
  response at all (raised by responders made with `raise_on_failure`,
  where a state built without it would be taken for a real one)."""


def _failed(error: str) -> ParsedResponse:
  return ParsedResponse("", (), (LineError(None, "", error),))


def policy_responder(chat: ChatModel, encoder: Encoder, top_k: int = 20,
                     failures: collections.Counter | None = None,
                     raise_on_failure: bool = False) -> Responder:
  """One DSL response per session from `chat` (Listings 6-7). A failed
  call is counted, then raises `CallFailed` with `raise_on_failure`, else
  gives an invalid response (the bank is left unchanged)."""
  def respond(bank: MemoryBank, session: Session) -> ParsedResponse:
    retrieved = retrieve_per_type(bank, encoder, session.format(), top_k)
    result, = chat.chat_many([build_policy_messages(bank, session, retrieved)])
    if not result.ok:
      if failures is not None:
        failures["policy_call"] += 1
      if raise_on_failure:
        raise CallFailed(f"policy call failed: {result.error}")
      return _failed(f"policy call failed: {result.error}")
    return parse(result.text or "")
  return respond


def agents_responder(chat: ChatModel, encoder: Encoder, top_k: int = 20,
                     core_cap: int = 5000,
                     failures: collections.Counter | None = None,
                     raise_on_failure: bool = False) -> Responder:
  """The four JSON agents per session, asked concurrently. A failed agent
  call is counted, then raises `CallFailed` with `raise_on_failure`, else
  is a missing line for its type (the response is invalid)."""
  def respond(bank: MemoryBank, session: Session) -> ParsedResponse:
    retrieved = retrieve_per_type(bank, encoder, session.format(), top_k)
    types = list(MemoryType)
    prompts = [build_agent_prompt(t, bank, session, retrieved.get(t, []),
                                  core_cap) for t in types]
    results = chat.chat_many([[{"role": "user", "content": p}]
                              for p in prompts])
    outputs, errors = {}, []
    for memory_type, result in zip(types, results):
      if result.ok:
        outputs[memory_type] = result.text or ""
      else:
        errors.append(f"{memory_type.value} agent call failed: "
                      f"{result.error}")
        if failures is not None:
          failures["agent_call"] += 1
    if errors and raise_on_failure:
      raise CallFailed("; ".join(errors))
    # A failed agent is a missing line for its type: the response is
    # invalid and the bank stays as it was.
    return combine_agent_outputs(outputs)
  return respond
