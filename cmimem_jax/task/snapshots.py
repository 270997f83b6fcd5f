"""Memory states `M_{t-1}` for every training session (SPEC §5).

Two sources (`rl.snapshots`):
* fixed expert states (the paper's protocol, MemBuilder's `state_before`):
  a teacher model's trajectory through each dialogue, built once by
  `tools/build_expert_states.py` (`build_expert_snapshots`) and never
  rebuilt;
* "policy": built by running the policy (greedy) through the training
  dialogues, cached on disk per version, refreshed by the current policy
  every K epochs (small CPU runs).

Both are stored alike: `DIR/<dialogue_id>/s<t>/` holds `M_{t-1}` of
session t (a `MemoryBank` directory); DIR may be local or `gs://`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from absl import logging

from cmimem_jax import storage
from cmimem_jax.client import Messages
from cmimem_jax.data.files import path_under, read_jsonl, write_json
from cmimem_jax.data.types import Dialogue
from cmimem_jax.encoders.base import Encoder
from cmimem_jax.evaluation.builders import CallFailed
from cmimem_jax.memory.apply import MemoryEditors
from cmimem_jax.memory.bank import MemoryBank
from cmimem_jax.memory.builder import MemoryConfig, Responder
from cmimem_jax.memory.dsl import ParsedResponse, parse
from cmimem_jax.memory.prompt_builder import PolicyPrompter
from cmimem_jax.memory.types import MemoryType
from cmimem_jax.task.episode import apply_to_copy

# In an expert-states directory: what built it, and one record per teacher
# response.
STATES_FILE = "states.json"
TEACHER_LOG = "teacher.jsonl"


def build_snapshots(dialogues: Sequence[Dialogue],
                    respond: Callable[[list[Messages]], list[str]],
                    prompter: PolicyPrompter, encoder: Encoder, memory: MemoryConfig,
                    editors: MemoryEditors = MemoryEditors()
                    ) -> list[list[MemoryBank]]:
  """`M_{t-1}` for every session of every dialogue, built by running the
  policy (greedy, on `prompter`'s prompts) through the dialogues; session
  t of all dialogues is one batched `respond` call.

  Returns:
    `banks[d][t]`: the bank before session t of dialogue d.
  """
  banks = [[MemoryBank(d.dialogue_id, encoder.dim)] for d in dialogues]
  longest = max(len(d.sessions) for d in dialogues)
  for t in range(longest - 1):  # The last session's successor is unused.
    active = [i for i, d in enumerate(dialogues) if t + 1 < len(d.sessions)]
    messages = [prompter(banks[i][t], dialogues[i].sessions[t])
                for i in active]
    for i, text in zip(active, respond(messages)):
      session = dialogues[i].sessions[t]
      banks[i].append(apply_to_copy(banks[i][t], session, parse(text),
                                    encoder, memory, editors))
  return banks


def _saved_prefix(directory: str, dialogue: Dialogue) -> int:
  """How many consecutive states `s0, s1, …` of `dialogue` are saved."""
  count = 0
  while count < len(dialogue.sessions) and _saved(
      path_under(directory, dialogue.dialogue_id, f"s{count}")):
    count += 1
  return count


def _saved(bank_directory: str) -> bool:
  """Whether a `MemoryBank` was saved (completely) in `bank_directory`."""
  return storage.path(storage.join(bank_directory, "CURRENT")).exists()


def teacher_records(directory: str) -> dict[tuple[str, int], dict[str, Any]]:
  """The newest teacher record per (dialogue id, session index)."""
  return {(r["dialogue_id"], r["session_index"]): r
          for r in read_jsonl(storage.join(directory, TEACHER_LOG))}


def expert_responses(directory: str
                     ) -> dict[tuple[str, int], ParsedResponse]:
  """The teacher's valid response per (dialogue id, session index): what
  turned `M_{t-1}` into the next state, the reward's length reference
  (`reward.length_reference`). Sessions whose teacher response was
  rejected, and each dialogue's last session (never built), have none."""
  return {key: parse(record["response"])
          for key, record in teacher_records(directory).items()
          if record["valid"]}


def _failed_call_record(record: dict[str, Any], answer_format: str) -> bool:
  """Whether a teacher record is a failed call that an earlier version of
  `build_expert_snapshots` logged as a rejected response (and built the
  next state from). DSL: the responder's "policy call failed" error; the
  four agents: an answer without every agent's output."""
  if answer_format != "agents":
    return any("call failed" in e for e in record.get("errors", ()))
  try:
    outputs = json.loads(record.get("response") or "{}")
  except ValueError:
    return False
  return isinstance(outputs, dict) and not {t.value for t in MemoryType} <= (
      set(outputs))


def _resume_point(directory: str, dialogue: Dialogue,
                  records: dict[tuple[str, int], dict[str, Any]],
                  answer_format: str) -> int:
  """How many states `s0, s1, …` of `dialogue` are saved and real: a state
  built past a failed teacher call (by an earlier version) is not, and it
  and every later state are removed here, to be built again."""
  saved = _saved_prefix(directory, dialogue)
  for t in range(saved - 1):
    record = records.get((dialogue.dialogue_id, t))
    if record is not None and _failed_call_record(record, answer_format):
      logging.warning("%s: state s%d was built past a failed teacher call: "
                      "building s%d.. again", dialogue.dialogue_id, t + 1,
                      t + 1)
      for later in range(t + 1, saved):
        storage.path(path_under(directory, dialogue.dialogue_id,
                                f"s{later}")).rmtree()
      return t + 1
  return saved


def build_expert_snapshots(dialogues: Sequence[Dialogue], respond: Responder,
                           encoder: Encoder, memory: MemoryConfig, directory: str,
                           settings: dict[str, Any],
                           editors: MemoryEditors = MemoryEditors()
                           ) -> dict[str, int]:
  """Fixed expert states: `respond` (a teacher) builds each dialogue's
  memory session by session; `M_{t-1}` of every session is saved as soon
  as it exists, so a rerun continues from the newest saved state. An
  invalid teacher response leaves the bank unchanged (as at evaluation)
  and is counted; every response is logged in `TEACHER_LOG`. A failed
  teacher call (`CallFailed`: no response at all) is never a state: the
  dialogue stops there, nothing more of it is saved, and the next run
  asks again.

  Args:
    settings: what the states depend on (encoder, memory, teacher), kept
      in `STATES_FILE`; a rerun with other settings is refused.

  Returns:
    `{"dialogues", "sessions", "built", "rejected", "failed", "missing"}`
    over the whole directory (`built`: teacher calls made by this run that
    gave a state; `failed`: dialogues this run stopped at a failed call;
    `missing`: states still to build).

  Raises:
    ValueError: the directory holds states of other settings.
  """
  storage.makedirs(directory)
  settings_path = storage.path(storage.join(directory, STATES_FILE))
  settings = json.loads(json.dumps(settings))  # Tuples as lists, as stored.
  if settings_path.exists():
    stored = json.loads(settings_path.read_text())
    if stored != settings:
      changed = sorted(k for k in stored.keys() | settings.keys()
                       if stored.get(k) != settings.get(k))
      raise ValueError(f"{directory} holds expert states of other settings "
                       f"({', '.join(changed)}): use a new directory")
  else:
    write_json(settings_path, settings)
  answer_format = settings.get("teacher", {}).get("format", "")
  records = teacher_records(directory)
  built = failed = 0
  with storage.Appender(storage.join(directory, TEACHER_LOG)) as log:
    for dialogue in dialogues:
      saved = _resume_point(directory, dialogue, records, answer_format)
      if saved == 0:
        bank = MemoryBank(dialogue.dialogue_id, encoder.dim)
        bank.save(path_under(directory, dialogue.dialogue_id, "s0"))
        saved = 1
      else:
        bank = MemoryBank.load(path_under(directory, dialogue.dialogue_id,
                                          f"s{saved - 1}"))
      for t in range(saved - 1, len(dialogue.sessions) - 1):
        session = dialogue.sessions[t]
        try:
          response = respond(bank, session)
        except CallFailed as e:
          failed += 1
          logging.warning("%s session %d: no state built, the teacher call "
                          "failed (%s)", dialogue.dialogue_id, t, e)
          break
        built += 1
        log.write(json.dumps({
            "dialogue_id": dialogue.dialogue_id, "session_index": t,
            "valid": response.valid, "response": response.text,
            "errors": [str(e) for e in response.errors]}) + "\n")
        log.flush()
        if response.valid:
          bank = apply_to_copy(bank, session, response, encoder, memory,
                               editors)
        else:
          logging.warning("%s session %d: teacher response rejected: %s",
                          dialogue.dialogue_id, t,
                          [str(e) for e in response.errors][:3])
        bank.save(path_under(directory, dialogue.dialogue_id, f"s{t + 1}"))
  records = teacher_records(directory)
  return {"dialogues": len(dialogues),
          "sessions": sum(len(d.sessions) for d in dialogues),
          "built": built,
          "rejected": sum(not r["valid"]
                          and not _failed_call_record(r, answer_format)
                          for r in records.values()),
          "failed": failed,
          "missing": sum(len(d.sessions) - _saved_prefix(directory, d)
                         for d in dialogues)}


def load_expert_snapshots(directory: str, dialogues: Sequence[Dialogue],
                          encoder_settings: dict[str, Any]
                          ) -> list[list[MemoryBank]]:
  """The fixed expert states of every training session.

  Raises:
    ValueError: no expert states there, built with another encoder
      (kind, width or query instruction), or some state missing.
  """
  path = storage.path(storage.join(directory, STATES_FILE))
  if not path.exists():
    raise ValueError(f"rl.snapshots={directory!r} holds no expert states "
                     f"({STATES_FILE} missing): build them with "
                     "python -m tools.build_expert_states")
  stored = json.loads(path.read_text()).get("encoder", {})
  keys = ("kind", "dim", "query_instruction")
  if any(stored.get(k) != encoder_settings.get(k) for k in keys):
    raise ValueError(
        f"the expert states in {directory} were embedded with encoder "
        f"{ {k: stored.get(k) for k in keys} }, this run uses "
        f"{ {k: encoder_settings.get(k) for k in keys} }: rebuild them")
  missing = [f"{d.dialogue_id}/s{_saved_prefix(directory, d)}"
             for d in dialogues
             if _saved_prefix(directory, d) < len(d.sessions)]
  if missing:
    raise ValueError(f"{len(missing)} dialogues lack expert states in "
                     f"{directory} (first missing: {missing[:3]}): finish "
                     "them with python -m tools.build_expert_states")
  banks = load_snapshots(directory, dialogues)
  assert banks is not None  # Every state was just found.
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
      if not _saved(path):
        return None
      per_dialogue.append(MemoryBank.load(path))
    banks.append(per_dialogue)
  return banks
