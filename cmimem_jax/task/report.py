"""The training job's human-readable report (`make demo`): the reward per
step and what the policy writes into memory for one session, before and
after GRPO, as entries a person can read rather than raw DSL."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from typing import Any

from cmimem_jax.encoders.base import Encoder
from cmimem_jax.memory.bank import MemoryBank
from cmimem_jax.memory.builder import MemoryConfig
from cmimem_jax.memory.dsl import parse
from cmimem_jax.task.episode import Episode, apply_to_copy

# (metrics key, column title) of the reward table.
REWARD_COLUMNS = (("reward_mean", "reward"),
                  ("reward_group_std", "group spread"),
                  ("reward/cmi", "cmi"), ("reward/qa", "qa"),
                  ("validity_rate", "valid"), ("loss", "loss"))
WIDTH = 100


def reward_table(history: Sequence[dict[str, Any]]) -> list[str]:
  """One row per step; a skipped (non-finite) update's loss shows as nan.
  `group spread` is the mean within-group reward std (what GRPO learns
  from: 0 means no signal)."""
  lines = ["step " + "".join(f"{title:>14}" for _, title in REWARD_COLUMNS)]
  for m in history:
    values = [m.get(key) for key, _ in REWARD_COLUMNS]
    lines.append(f"{m['step']:4d} " + "".join(
        f"{float('nan') if v is None else v:14.4f}" for v in values))
  return lines


def _clip(text: str, width: int) -> str:
  return textwrap.shorten(" ".join(text.split()), width, placeholder=" …")


def memory_changes(before: MemoryBank, after: MemoryBank,
                   max_lines: int = 6) -> list[str]:
  """What `after` holds that `before` did not: `+ [type] text` for a new
  entry, `~ [type] text` for a rewritten one, `- [type] text` for a
  deleted one, and the core block's new lines; at most `max_lines` lines
  (the rest counted)."""
  old = {e.entry_id: e for e in before.entries()}
  new = {e.entry_id: e for e in after.entries()}
  lines = []
  old_core = set(before.core.splitlines())
  lines += [f"+ [core] {_clip(line, WIDTH - 9)}"
            for line in after.core.splitlines()
            if line.strip() and line not in old_core]
  for entry_id, entry in new.items():
    tag = f"[{entry.memory_type.value}]"
    if entry_id not in old:
      lines.append(f"+ {tag} {_clip(entry.text, WIDTH - len(tag) - 3)}")
    elif old[entry_id].text != entry.text:
      lines.append(f"~ {tag} {_clip(entry.text, WIDTH - len(tag) - 3)}")
  lines += [f"- [{e.memory_type.value}] {_clip(e.text, WIDTH - 15)}"
            for entry_id, e in old.items() if entry_id not in new]
  if len(lines) > max_lines:
    lines = lines[:max_lines] + [f"  … and {len(lines) - max_lines} more"]
  return lines or ["(nothing new)"]


def written_memory(episode: Episode, response: str, encoder: Encoder,
                   memory: MemoryConfig, max_lines: int = 6) -> list[str]:
  """The memory a response writes for `episode`'s session, as readable
  lines (`memory_changes` of M_{t-1} -> M_t), or why it was rejected."""
  parsed = parse(response)
  if not parsed.valid:
    return [f"(invalid response, memory unchanged: "
            f"{_clip(str(parsed.errors[0]), WIDTH - 40)})"]
  after = apply_to_copy(episode.bank, episode.session, parsed, encoder,
                        memory)
  return memory_changes(episode.bank, after, max_lines)


def session_line(episode: Episode) -> str:
  """`N turns: "first user turn …"`: what the session is about."""
  users = episode.session.user_turns() or [t.text for t in
                                           episode.session.turns]
  first = _clip(users[0], WIDTH - 30) if users else ""
  return f"{len(episode.session.turns)} turns: \"{first}\""


def summary_text(history: Sequence[dict[str, Any]], session: str,
                 about: str, before: Sequence[str], after: Sequence[str],
                 start: str = "the loaded model") -> str:
  """The demo's report: the reward table, then one session's memory
  written by the policy GRPO started from (`start` says which) and by the
  trained policy."""
  lines = ["", "=== CMI-Mem training summary ===", *reward_table(history),
           "", f"--- session {session} ({about}) ---",
           f"memory written before GRPO ({start}):",
           *before, "memory written after GRPO:", *after]
  return "\n".join(lines)
