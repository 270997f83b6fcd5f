"""The App. E log-prob CMI estimator (Listing 8; Table 9 "w. logprob").

A reference LM writes a user profile from the memory state after the
rollout, `M_t`, and the session (Listing 8, greedy); the estimate is how
much more likely that profile is given `M_t` than given `M_{t-1}`:

  Δ = mean log p(profile | M_t, C_t) − mean log p(profile | M_{t-1}, C_t)

in nats per token. It is one number per rollout (App. E differences whole
memory states), so every scored operation of the rollout gets it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import jax
import numpy as np

from cmimem_jax.client import Messages
from cmimem_jax.memory.bank import MemoryBank
from cmimem_jax.memory.prompts import render_template
from cmimem_jax.memory.types import ENTRY_TYPES
from cmimem_jax.models.qwen3.model import Qwen3
from cmimem_jax.rl.logprobs import mean_continuation_logprobs
from cmimem_jax.sampling.policy import ChatPolicy


def memory_text(bank: MemoryBank, max_entries: int = 20) -> str:
  """Listing 8's `{memory_text}`: the core block and the newest
  `max_entries` entries of each type."""
  lines = ["Core memory:", bank.core.strip() or "(empty)"]
  for memory_type in ENTRY_TYPES:
    entries = bank.entries(memory_type)[-max_entries:]
    lines.append(f"{memory_type.value.capitalize()} memories:")
    lines += [f"- {e.text}" for e in entries] or ["(none)"]
  return "\n".join(lines)


def profile_messages(bank: MemoryBank, context: str) -> Messages:
  """Listing 8 as one user message."""
  return [{"role": "user", "content": render_template(
      "user_profile", memory_text=memory_text(bank), context=context)}]


class ProfileLM(Protocol):
  """What the estimator needs of a reference LM."""

  def profile_gain(self, before: Sequence[Messages],
                   after: Sequence[Messages]) -> np.ndarray:
    """`[B]` Δ: the profile written under `after[i]`, scored under both."""
    ...


class PolicyProfileLM:
  """`ProfileLM` over a `ChatPolicy`: profiles from its engine (greedy,
  free text), scores from the JAX weights `model()` returns. The training
  loop gives it the frozen reference p_ref (App. A / H.3), so a policy
  update never moves the estimate."""

  def __init__(self, policy: ChatPolicy, model: Callable[[], Qwen3],
               max_new_tokens: int = 256, chunk: int = 256):
    self.policy, self.model = policy, model
    self.max_new_tokens, self.chunk = max_new_tokens, chunk

  def profile_gain(self, before: Sequence[Messages],
                   after: Sequence[Messages]) -> np.ndarray:
    prompts_after = [self.policy.encode(m) for m in after]
    prompts_before = [self.policy.encode(m) for m in before]
    out = self.policy.generate(prompts_after, jax.random.key(0), 0.0, 1.0,
                               self.max_new_tokens, constrained=False)
    profiles = [self.policy.completion_tokens(out, i)
                for i in range(len(after))]
    model = self.model()
    score = lambda prompts: mean_continuation_logprobs(  # noqa: E731
        model, prompts, profiles, self.policy.pad_id, self.chunk)
    return score(prompts_after) - score(prompts_before)
