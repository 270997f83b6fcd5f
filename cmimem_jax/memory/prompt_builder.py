"""Fills the method's prompt templates from banks, sessions and questions;
`PolicyPrompter`, the one place the policy's prompt is built."""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Mapping, Sequence

from cmimem_jax.client import Messages, PromptFits
from cmimem_jax.data.types import Session
from cmimem_jax.encoders.base import Encoder
from cmimem_jax.memory.bank import MemoryBank, SearchHit
from cmimem_jax.memory.prompts import render_template
from cmimem_jax.memory.retrieval import Chunk, retrieve_per_type
from cmimem_jax.memory.types import MemoryType

NONE_TEXT = "(none)"


def format_memories(hits: Sequence[SearchHit]) -> str:
  """Retrieved entries as `- text` lines, or "(none)"."""
  if not hits:
    return NONE_TEXT
  return "\n" + "\n".join(f"- {hit.entry.text}" for hit in hits)


def session_date_text(session: Session) -> str:
  if session.date is not None:
    return session.date.strftime("%Y-%m-%d %H:%M")
  return session.date_text or "unknown date"


def build_policy_messages(bank: MemoryBank, session: Session,
                          retrieved: Mapping[MemoryType, Sequence[SearchHit]]
                          ) -> list[dict[str, str]]:
  """The policy's chat messages for one session (Listings 6-7).

  Args:
    bank: `M_{t-1}` (its core block is always shown in full).
    session: The session `C_t` to memorise.
    retrieved: Top-k entries per entry type (`retrieve_per_type`).

  Returns:
    `[{"role": "system", ...}, {"role": "user", ...}]`.
  """
  user = render_template(
      "policy_user",
      core_memory=bank.core or NONE_TEXT,
      episodic_memories=format_memories(retrieved.get(MemoryType.EPISODIC, [])),
      semantic_memories=format_memories(retrieved.get(MemoryType.SEMANTIC, [])),
      procedural_memories=format_memories(
          retrieved.get(MemoryType.PROCEDURAL, [])),
      session_index=session.index + 1,
      session_date=session_date_text(session),
      session_text=session.format())
  return [{"role": "system", "content": render_template("policy_system")},
          {"role": "user", "content": user}]


@dataclasses.dataclass(frozen=True)
class PolicyPrompter:
  """The policy's prompt for a session `C_t` on a bank `M_{t-1}`
  (Listings 6-7), one path for every reader: training's rollouts,
  validation and policy-built snapshots, evaluation's `policy` builder,
  the warm start's teacher records.

  The core block in full, the session, and the `top_k` entries of each
  type closest to the session text (none from an empty bank, nor with
  `top_k` = 0: no encoder call). With `fits` (the prompt budget of the
  model that reads the prompt, e.g. `ChatPolicy.prompt_fits`), a prompt it
  rejects shows fewer retrieved entries per type, each type's least
  similar dropped first, until it fits or none are left; a prompt that
  does not fit even then is returned as it is, for the model to refuse
  (`ChatPolicy.encode` names its limit).

  Attributes:
    encoder: Embeds the session text as the retrieval query.
    top_k: Entries retrieved per entry type (Alg. 1 TopK).
    fits: The reader's prompt budget; None: none known (an endpoint, whose
      server's context length is its own), the prompt is never trimmed.
  """
  encoder: Encoder
  top_k: int
  fits: PromptFits | None = None

  def __call__(self, bank: MemoryBank, session: Session) -> Messages:
    return self.fitted(bank, session)[0]

  def fitted(self, bank: MemoryBank, session: Session
             ) -> tuple[Messages, int]:
    """The messages, and how many retrieved entries per type they show
    (`top_k`, or fewer where the budget trimmed them)."""
    retrieved = (retrieve_per_type(bank, self.encoder, session.format(),
                                   self.top_k)
                 if self.top_k > 0 and len(bank) else {})
    k = self.top_k
    messages = build_policy_messages(bank, session, retrieved)
    while self.fits is not None and k > 0 and not self.fits(messages):
      k -= 1
      messages = build_policy_messages(
          bank, session, {t: hits[:k] for t, hits in retrieved.items()})
    return messages, k


def build_agent_prompt(memory_type: MemoryType, bank: MemoryBank,
                       session: Session, retrieved: Sequence[SearchHit],
                       core_cap: int = 5000) -> str:
  """One of the four JSON agent prompts (Listings 1-4) for a session."""
  messages = session.format()
  if memory_type is MemoryType.CORE:
    return render_template(
        "core_agent", core_memory=bank.core or NONE_TEXT,
        core_usage=round(100 * len(bank.core) / core_cap, 1),
        core_cap=core_cap, messages=messages)
  values = {"memories": format_memories(retrieved), "messages": messages}
  if memory_type is MemoryType.EPISODIC:
    values["conversation_timestamp"] = session_date_text(session)
  return render_template(f"{memory_type.value}_agent", **values)


def build_compression_prompt(core: str, limit: int = 5000,
                             target: int = 3000) -> str:
  """Listing 5 for a core block over its trigger."""
  return render_template("core_compression", length=len(core), limit=limit,
                         target=target, content=core)


def build_merge_prompt(agent_type: str, memories: Sequence[str]) -> str:
  """Listing 9 over the memories a MERGE consolidates (one per line)."""
  return render_template("merge_summary", agent_type=agent_type,
                         memories_text="\n".join(f"- {m}" for m in memories))


def build_answer_prompt(question: str, bank: MemoryBank,
                        hits: Sequence[SearchHit], chunks: Sequence[Chunk],
                        current_time: dt.datetime | str | None,
                        additional_context: str = "",
                        sessions: Sequence[Session] = ()) -> str:
  """Listing 10: core + retrieved fragments + source chunks + time info.

  `TimeInfo(R)` of Alg. 2: each fragment is stamped with the date of the
  session it came from (`sessions`, the dialogue's), so relative times in
  it can be resolved; "[session N]" only when that session is unknown.
  """
  if isinstance(current_time, dt.datetime):
    current_time = current_time.strftime("%Y-%m-%d %H:%M")
  memories = []
  for hit in hits:
    index = hit.entry.session_index
    stamp = (session_date_text(sessions[index]) if 0 <= index < len(sessions)
             else f"session {index + 1}")
    memories.append(f"[{stamp}] {hit.entry.text}")
  return render_template(
      "answer", additional_context=additional_context,
      core_memory=bank.core or NONE_TEXT, memories=memories,
      chunk_context="\n\n".join(c.format() for c in chunks),
      current_time=current_time or "unknown", question=question)


def build_judge_prompt(question: str, gold_answer: str,
                       generated_answer: str) -> str:
  """Listing 11."""
  return render_template("judge", question=question, gold_answer=gold_answer,
                         generated_answer=generated_answer)
