"""The QA pairs synthesized for RL training (paper Table 5; the MemBuilder
protocol: single-session, multi-session and temporal questions): what the
model is asked for each session and how its answer is read.
`tools/synthesize_qa.py` sends these prompts and keeps the pairs.

What the model is shown:
* with expert states (`tools/synthesize_qa.py --expert_states=DIR`, the
  paper's protocol: its training data is "synthesized by deepseek-v4-pro
  following the protocol of Shen et al. (2026)", i.e. MemBuilder's): the
  expert memory state `M_{t-1}` before each session, as
  `tools/build_expert_states.py` saved it
  (`DIR/<question_id>/s<t>/`; build the states from the QA-less records
  first), rendered into MemBuilder's prompt (`MEMORY_PROMPT`). MemBuilder
  (github.com/Zh1yuShen/MemBuilder @ 422d053): `prompts.py:375-470`
  (`QA_GENERATION_PROMPT`, ported verbatim: the core block, then every
  episodic, semantic and procedural memory, one a line, then the session
  and its timestamp; 50% single-session, 30% multi-session, 20%
  temporal-reasoning); `qa_generator.py:33-91` (`generate_qa`: 5 questions
  by default, temperature 0.0, `{"questions": [...]}` answers);
  `scripts/prepare_rl_data.py:189-207` (the README's `--add-qa
  --qa-per-session 5` path: the state is the session's
  `state_before_path`, all stored memories, not a retrieved top-k). Its
  other entry point, `qa_generator.py:189-316`
  (`generate_qa_from_trajectories`), loads the state *after* the session
  (`state_{N+1}`); we follow `prepare_rl_data.py`, whose state matches
  the prompt's "Memory State from Previous Steps" and the states the
  trainer reads (the last session's after-state is never built). Departures:
  turns are rendered `user: ...` (MemBuilder: `[REAL_USER]: ...`), the
  `source` field is dropped and MemBuilder's `temporal-reasoning` is
  stored as our `temporal` (`parse_pairs`). The default temperature is
  MemBuilder's 0.0.
* without it (a cheaper stand-in when no expert states exist): our own
  prompt (`PROMPT`) over the session, its date and the last 3,000
  characters of the earlier sessions (600 of each), temperature 0.7.
"""

from __future__ import annotations

import os

from cmimem_jax.data.files import path_under
from cmimem_jax.memory.bank import MemoryBank
from cmimem_jax.memory.json_agents import loads_llm_json
from cmimem_jax.memory.types import MemoryType
from cmimem_jax.task.snapshots import STATES_FILE

QA_TYPES = ("single-session", "multi-session", "temporal")
# MemBuilder's type names that mean one of ours.
QA_TYPE_ALIASES = {"temporal-reasoning": "temporal"}

PROMPT = """\
You write evaluation questions for a personal assistant's long-term memory.
Below is session {index} of a conversation between a user and an assistant,
dated {date}, preceded by a summary of the earlier sessions.

Earlier sessions:
{history}

Session {index} ({date}):
{session}

Write exactly {n} question-answer pairs that can be answered only by
remembering this session: mostly "single-session" facts about the user from
this session, at least one "temporal" question about when something
happened (use the session date), and, when the earlier sessions allow, one
"multi-session" question combining this session with an earlier one.
Answers are short (a few words). Return only JSON:
{{"pairs": [{{"question": "...", "answer": "...",
             "type": "single-session|multi-session|temporal"}}]}}"""

# MemBuilder's QA_GENERATION_PROMPT (prompts.py:375-470 @ 422d053), verbatim.
MEMORY_PROMPT = """\
You are an expert at generating precise, specific verification questions for testing memory systems.

**EVALUATION SCENARIO:**
You are creating questions to test a memory system. Here's how the evaluation works:

1. **Memory Building Phase (Already Done)**: A memory system has processed the conversation history up to this point and stored memories in a vector database.

2. **Question Answering Phase (What You're Preparing For)**: 
   - The answering model will receive ONLY your question
   - The answering model will search the memory database using your question as a query
   - The answering model will retrieve relevant memories (episodic, semantic, procedural)
   - The answering model will answer based ONLY on retrieved memories
   - **CRITICAL**: The answering model CANNOT see the original conversation text

3. **Your Task**: Generate questions that:
   - Test whether the memory system correctly captured information from the current session
   - Include enough context/anchors so the question itself can retrieve the right memories
   - Are answerable using only the information stored in the memory database

**Memory State from Previous Steps (All Retrieved Memories):**

Core Memory:
{core_memory}

Episodic Memories (事件记忆):
{episodic_memories}

Semantic Memories (概念记忆):
{semantic_memories}

Procedural Memories (过程记忆):
{procedural_memories}

**Current Session Conversation (Newly Added):**
{current_session}

Session Timestamp: {session_timestamp}

---

**QUESTION GENERATION GUIDELINES:**

**Critical Rules:**

1. **Use First Person Perspective**: All questions MUST be phrased from the user's perspective using "I/my/me".
   - ✅ CORRECT: "What is my favorite hobby?"
   - ❌ WRONG: "What is the user's favorite hobby?"

2. **Ask About Facts, NOT Opinions**: Questions must have objective, verifiable answers.
   - ✅ CORRECT: "What city did I visit last month?" (factual, verifiable)
   - ❌ WRONG: "How do I feel about my job?" (subjective, opinion-based)

3. **Single Retrievable Answer**: Each question should have ONE clear answer that can be found through memory search.

4. **Natural Question Phrasing**: Use conversational, natural language

5. **Be Specific with Anchors**: Each question MUST include specific anchoring information (names, dates, places, events, products, activities) to help retrieve the correct memories.

6. **Avoid Vague Reasoning**: Do NOT ask abstract relationship questions like "How does X relate to Y?"

7. **Concrete Facts Only**: Focus on verifiable, concrete facts that have clear, unambiguous answers.

**Question Types:**
- **current_session**: Ask about NEW information from the current session
- **cross_session**: Connect current session mentions with historical details

**QUESTION TYPES AND DISTRIBUTION:**
Generate exactly {num_questions} questions with the following distribution:

1. **single-session** (Target: 50% = 2-3 questions)
   - Tests memory retention from current session ONLY
   - Information found ONLY in the current session

2. **multi-session** (Target: 30% = 1-2 questions)
   - Requires information from MULTIPLE sessions
   - Needs to aggregate/count/compare across sessions

3. **temporal-reasoning** (Target: 20% = 1 question)
   - Involves time calculation, date comparison, or event ordering
   - Requires reasoning about temporal relationships

**OUTPUT FORMAT:**
Return a JSON object with this EXACT structure:
{{
  "questions": [
    {{
      "question": "What is my favorite hobby?",
      "answer": "Photography",
      "type": "single-session|multi-session|temporal-reasoning|knowledge-update",
      "source": "current_session|cross_session"
    }},
    ... (exactly {{num_questions}} questions total)
  ]
}}

Return ONLY the JSON object, no additional text."""


def session_text(turns: list[dict]) -> str:
  return "\n".join(f"{t['role']}: {t['content']}" for t in turns)


def parse_pairs(text: str, n: int) -> list[dict] | None:
  """The first n well-formed pairs, or None if there are none. Reads our
  `{"pairs": [...]}` (`PROMPT`) and MemBuilder's `{"questions": [...]}`
  (`MEMORY_PROMPT`); types outside `QA_TYPES` and its aliases count as
  single-session."""
  try:
    value = loads_llm_json(text)
  except ValueError:
    return None
  items = (value.get("pairs", value.get("questions"))
           if isinstance(value, dict) else None)
  pairs = []
  for item in items if isinstance(items, list) else []:
    if (isinstance(item, dict) and str(item.get("question", "")).strip()
        and str(item.get("answer", "")).strip()):
      kind = QA_TYPE_ALIASES.get(item.get("type"), item.get("type"))
      pairs.append({"question": str(item["question"]).strip(),
                    "answer": str(item["answer"]).strip(),
                    "type": kind if kind in QA_TYPES else "single-session"})
  return pairs[:n] or None


def memory_state_text(bank: MemoryBank) -> dict[str, str]:
  """`MEMORY_PROMPT`'s memory fields for one state: the core block and
  every stored entry of each type, one a line (MemBuilder's placeholders
  for an empty slot)."""
  def lines(memory_type: MemoryType) -> str:
    return "\n".join(e.text for e in bank.entries(memory_type)) or "[None]"
  return {"core_memory": bank.core.strip() or "[Empty]",
          "episodic_memories": lines(MemoryType.EPISODIC),
          "semantic_memories": lines(MemoryType.SEMANTIC),
          "procedural_memories": lines(MemoryType.PROCEDURAL)}


def load_expert_states(directory: str, records: list[dict]
                       ) -> list[list[MemoryBank]]:
  """`banks[r][t]`: the expert state before session t of record r
  (`DIR/<question_id>/s<t>/`, written by `tools/build_expert_states.py`).

  Raises:
    ValueError: no expert states there, or some session's state missing.
  """
  if not os.path.exists(os.path.join(directory, STATES_FILE)):
    raise ValueError(f"--expert_states={directory!r} holds no expert states "
                     f"({STATES_FILE} missing): build them with "
                     "python -m tools.build_expert_states")
  paths = [[path_under(directory, record["question_id"], f"s{t}")
            for t in range(len(record["haystack_sessions"]))]
           for record in records]
  missing = [os.path.relpath(p, directory) for per_record in paths
             for p in per_record
             if not os.path.exists(os.path.join(p, "CURRENT"))]
  if missing:
    raise ValueError(f"{len(missing)} session states missing in {directory} "
                     f"(first: {missing[:3]}): finish them with "
                     "python -m tools.build_expert_states")
  return [[MemoryBank.load(p) for p in per_record] for per_record in paths]


def session_prompts(records: list[dict], per_session: int,
                    history_chars: int = 3000,
                    states: list[list[MemoryBank]] | None = None
                    ) -> list[tuple[tuple[int, str], list[dict]]]:
  """`((record index, session id), messages)` of every session: with
  `states` (`banks[r][t]`, `load_expert_states`) `MEMORY_PROMPT` over that
  state, else `PROMPT` over the last `history_chars` of the earlier
  sessions."""
  jobs = []
  for r, record in enumerate(records):
    history = []
    for s, (sid, date, turns) in enumerate(zip(
        record["haystack_session_ids"], record["haystack_dates"],
        record["haystack_sessions"])):
      text = session_text(turns)
      if states is not None:
        content = MEMORY_PROMPT.format(
            **memory_state_text(states[r][s]), current_session=text,
            session_timestamp=date, num_questions=per_session)
      else:
        content = PROMPT.format(
            index=s + 1, date=date, n=per_session, session=text,
            history="\n".join(history)[-history_chars:] or "(none)")
      jobs.append(((r, sid), [{"role": "user", "content": content}]))
      history.append(f"[{date}] {text[:600]}")
  return jobs
