"""Memory-building methods for evaluation (SPEC §6): `policy` (our DSL
policy, Listings 6-7) and `prompting` (the four JSON agents, Listings 1-4,
with any chat model: Ours-P / MemBuilder-P). Chat failures are counted
and give an invalid response (the bank is left unchanged), never a guess.

The `policy` builder's prompt is the one training gives the policy
(`memory.PolicyPrompter`), trimmed to the builder's prompt budget as
training trims to the policy's: a local model's (`ChatPolicy.prompt_fits`:
its context less its response budget) drops retrieved entries, each
type's least similar first, until the prompt fits; an endpoint's prompt
goes whole (its server's context length is its own; a refusal is a
failed call, counted).
"""

from __future__ import annotations

import collections

from cmimem_jax.client import ChatModel, PromptFits
from cmimem_jax.data.types import Session
from cmimem_jax.encoders.base import Encoder
from cmimem_jax.memory.bank import MemoryBank
from cmimem_jax.memory.builder import Responder
from cmimem_jax.memory.dsl import LineError, ParsedResponse, parse
from cmimem_jax.memory.json_agents import combine_agent_outputs
from cmimem_jax.memory.prompt_builder import (PolicyPrompter,
                                              build_agent_prompt)
from cmimem_jax.memory.retrieval import retrieve_per_type
from cmimem_jax.memory.types import MemoryType


class CallFailed(RuntimeError):
  """A builder's chat call failed after its retries: the session has no
  response at all (raised by responders made with `raise_on_failure`,
  where a state built without it would be taken for a real one)."""


def _failed(error: str) -> ParsedResponse:
  return ParsedResponse("", (), (LineError(None, "", error),))


def prompt_budget(chat: ChatModel) -> PromptFits | None:
  """The prompt budget `chat` enforces: a local policy's
  (`ChatPolicy.prompt_fits`); None for an endpoint."""
  return getattr(chat, "prompt_fits", None)


def policy_responder(chat: ChatModel, encoder: Encoder, top_k: int = 20,
                     failures: collections.Counter | None = None,
                     raise_on_failure: bool = False) -> Responder:
  """One DSL response per session from `chat` on the policy's prompt
  (`PolicyPrompter`, `top_k` entries per type, trimmed to
  `prompt_budget(chat)`). A failed call is counted, then raises
  `CallFailed` with `raise_on_failure`, else gives an invalid response
  (the bank is left unchanged)."""
  prompter = PolicyPrompter(encoder, top_k, prompt_budget(chat))

  def respond(bank: MemoryBank, session: Session) -> ParsedResponse:
    result, = chat.chat_many([prompter(bank, session)])
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
