"""Memory states `M_{t-1}` for every training session (SPEC §5): built by
running a policy (greedy) through the training dialogues, cached on disk
per version, refreshed by the current policy every K epochs."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from cmimem_jax.client import Messages
from cmimem_jax.data.files import path_under
from cmimem_jax.data.types import Dialogue
from cmimem_jax.encoders.base import Encoder
from cmimem_jax.memory.apply import MemoryEditors
from cmimem_jax.memory.bank import MemoryBank
from cmimem_jax.memory.dsl import parse
from cmimem_jax.task.episode import apply_to_copy, policy_messages


def build_snapshots(dialogues: Sequence[Dialogue],
                    respond: Callable[[list[Messages]], list[str]],
                    encoder: Encoder, memory: Any, top_k: int,
                    editors: MemoryEditors = MemoryEditors()
                    ) -> list[list[MemoryBank]]:
  """`M_{t-1}` for every session of every dialogue, built by running the
  policy (greedy) through the dialogues; session t of all dialogues is one
  batched `respond` call.

  Returns:
    `banks[d][t]`: the bank before session t of dialogue d.
  """
  banks = [[MemoryBank(d.dialogue_id, encoder.dim)] for d in dialogues]
  longest = max(len(d.sessions) for d in dialogues)
  for t in range(longest - 1):  # The last session's successor is unused.
    active = [i for i, d in enumerate(dialogues) if t + 1 < len(d.sessions)]
    messages = [policy_messages(banks[i][t], dialogues[i].sessions[t],
                                encoder, top_k) for i in active]
    for i, text in zip(active, respond(messages)):
      session = dialogues[i].sessions[t]
      banks[i].append(apply_to_copy(banks[i][t], session, parse(text),
                                    encoder, memory, editors))
  return banks


def save_snapshots(directory: str, banks: list[list[MemoryBank]]) -> None:
  for per_dialogue in banks:
    for t, bank in enumerate(per_dialogue):
      bank.save(path_under(directory, bank.user_id, f"s{t}"))


def load_snapshots(directory: str, dialogues: Sequence[Dialogue]
                   ) -> list[list[MemoryBank]] | None:
  """The cached snapshots, or None if any is missing."""
  banks = []
  for dialogue in dialogues:
    per_dialogue = []
    for t in range(len(dialogue.sessions)):
      path = path_under(directory, dialogue.dialogue_id, f"s{t}")
      if not os.path.exists(os.path.join(path, "CURRENT")):
        return None
      per_dialogue.append(MemoryBank.load(path))
    banks.append(per_dialogue)
  return banks
