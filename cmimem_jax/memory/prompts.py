"""Prompt templates of the method (paper Appendix H, Listings 1-11), as data.

Templates are Jinja2 (`{{ name }}`) so literal JSON braces need no escaping.
The listings are reproduced verbatim where the paper gives them in full;
the abridged ones are completed with the placeholders the paper's text
describes (existing memories and new messages). Fill them with
`render_template` (strict: a missing variable raises).
"""

from __future__ import annotations

import functools

import jinja2

CORE_AGENT = """\
You are the Core Memory Manager. Your role is to analyze user messages and
extract fundamental information about the user that will be beneficial in
future conversations.

Current Core Memory (Human Block):
{{ core_memory }}

Character Usage: {{ core_usage }}%

New Messages:
{{ messages }}

What to Extract and Save:
- User's name, identity, role, occupation, location
- Personality traits and characteristics
- Preferences and values (what they like/dislike, care about)
- Personal profile facts and background
- Key relationships (family, close friends, colleagues)
- Long-term projects, goals, and aspirations
- User behaviors and habits
- Critical life events and milestones

Instructions:
1. Examine all messages thoroughly to extract EVERY detail about the
user's preferences, personal information, and vital facts.
2. Decide on ONE operation:
- APPEND : Add new information to existing block (if <90% full)
- REPLACE: Update specific outdated or incorrect information
- REWRITE: Reorganize and consolidate the entire block
(if >90% full or major updates needed)

Return JSON with ONE of these operations:
{"operation": "APPEND", "content": "..."}
{"operation": "REPLACE", "old_text": "...", "new_text": "..."}
{"operation": "REWRITE", "content": "... (under {{ core_cap }} chars)"}

Return ONLY the JSON object. No explanations or extra text."""

EPISODIC_AGENT = """\
You are the Episodic Memory Manager. Manage time-ordered event memories.

Each episodic memory MUST include:
(a) summary : Short textual summary of the event
(b) timestamp : YYYY-MM-DD[ HH:MM] (absolute time only)
(c) details : Who, what, where, why, and the original time expression
(d) event_type : conversation | activity | observation | plan

IMPORTANT TIMESTAMP RULES:
Conversation Timestamp: {{ conversation_timestamp }}
- Use ONLY absolute dates (no "yesterday", "last week" in timestamps).
- Resolve relative expressions using the conversation timestamp.
- Preserve the original time expression in the Details field.

Existing Recent Episodic Memories:
{{ memories }}

New Messages:
{{ messages }}

For each new event, choose one action:
- ADD : Completely new event
- UPDATE : New related event referencing a prior record
(old version preserved in history)
- MERGE : Combine related events into a timeline with date range,
drawing well-supported conclusions

Return JSON:
{"operations": [
{"action": "ADD", "memory": "YYYY-MM-DD: summary | Details: ..."},
{"action": "UPDATE", "old_memory": "...", "new_memory": "..."},
{"action": "MERGE", "old_memories": [...], "new_memory": "..."}
]}

Output at most 50 operations per response. Return ONLY the JSON object."""

SEMANTIC_AGENT = """\
You are the Semantic Memory Manager. Manage conceptual knowledge about
people, places, objects, and concepts.

ONLY save NEW concepts that are NEW to you. DO NOT save common knowledge
such as well-known software, famous people, or common places.

GRANULARITY PRINCIPLE: Store information in FINE-GRAINED, TOPIC-SPECIFIC
entries. For people, split by aspect when appropriate:
{Name} - Career/Work | Hobbies/Interests | Family | Pets |
Personality/Values | Possessions

Each semantic memory entry MUST include:
(a) name : The concept/person/object name
(b) summary : A concise explanation
(c) details : Specific facts (attributes, relationships, history,
background, distinguishing features)
(d) category : person | object | place | concept | relationship

Existing Semantic Memories (sample):
{{ memories }}

New Messages:
{{ messages }}

For each concept, decide on operation:
- ADD : Completely new concept/person/object
- UPDATE : Add new information to an existing concept
- SKIP : Common knowledge or already fully captured

Return JSON:
{"operations": [
{"action": "ADD", "memory": "Name - Aspect: summary | Details: ..."},
{"action": "UPDATE", "old_memory": "...", "new_memory": "..."},
{"action": "SKIP", "reason": "..."}
]}

Return ONLY the JSON object."""

PROCEDURAL_AGENT = """\
You are the Procedural Memory Manager. Manage step-by-step processes,
workflows, and instructions.

Each procedural memory entry MUST include:
(a) entry_type : workflow | guide | recipe | troubleshooting | routine
(b) description : Short descriptive text
(c) steps : Numbered, specific steps
(times, temperatures, quantities, tools)
(d) context : When/where/why this procedure is used

Existing Procedural Memories:
{{ memories }}

New Messages:
{{ messages }}

For each procedure, choose:
- ADD : New procedure or workflow
- UPDATE : Revise an existing procedure with corrections/additions

Most conversations contain no procedural content -- in that case return an
empty operations array.

Return JSON:
{"operations": [
{"action": "ADD",
"memory": "Description | Steps: 1. ... 2. ... | Context: ..."},
{"action": "UPDATE", "old_memory": "...", "new_memory": "..."}
]}"""

CORE_COMPRESSION = """\
The Core Memory is too long ({{ length }} chars, limit: {{ limit }}).
Compress it to under {{ target }} characters, keeping only core identity and
critical facts:
- User's name, role, occupation, key relationships
- Personality traits and important preferences
- Long-term goals and critical life events
- Unique characteristics that define the user

Remove or compress:
- Redundant descriptions and verbose explanations
- Minor details and conversational context
- Detailed examples (keep only key takeaways)

Current content:
{{ content }}

Output format: {"content": "compressed version under {{ target }} chars"}
Respond with ONLY the JSON object."""

POLICY_SYSTEM = """\
You are a Memory Manager. After each conversation session, output memory
operations in compact DSL format (one operation per line).

Memory types: CORE, EPISODIC, SEMANTIC, PROCEDURAL.

Format -- each line is TYPE:ACTION|field1|field2:
CORE:APPEND|new info to add
CORE:REPLACE|old text|new text
CORE:REWRITE|rewritten profile text
EPISODIC:SKIP
EPISODIC:ADD|YYYY-MM-DD: event summary
EPISODIC:UPDATE|old memory text|new memory text
SEMANTIC:SKIP
SEMANTIC:ADD|Topic - concise fact
SEMANTIC:UPDATE|old memory text|new memory text
PROCEDURAL:SKIP
PROCEDURAL:ADD|How to X: 1. step 2. step

Rules:
- Output ONLY DSL lines. No explanations, no markdown, no JSON.
- Every response MUST include exactly one line for CORE
(APPEND/REPLACE/REWRITE).
- For EPISODIC, SEMANTIC, PROCEDURAL: output one or more ADD/UPDATE
lines, or a single SKIP line if nothing relevant.
- Be concise: 1 sentence per memory entry. No redundancy.
- Use | as field separator. Do not use | inside field values."""

POLICY_USER = """\
[Memory] Core: {{ core_memory }}
[Memory] Episodic: {{ episodic_memories }}
[Memory] Semantic: {{ semantic_memories }}
[Memory] Procedural: {{ procedural_memories }}

[Session #{{ session_index }}, {{ session_date }}]
{{ session_text }}

Output memory operations:"""

USER_PROFILE = """\
You are a user profiling assistant. Based on the memory state and
conversation below, write a concise but comprehensive profile of this
user. Include their preferences, personality traits, key facts, and any
important context about their life.

Memory state:
{{ memory_text }}

Recent conversation:
{{ context }}

Write a brief user profile based on the above information."""

MERGE_SUMMARY = """\
You are a memory management assistant. Merge the following {{ agent_type }}
memories into a single, concise summary that preserves all key facts,
timestamps, and details. Do NOT add any information not present in the
original memories. Output only the merged memory text, nothing else.

Memories to merge:
{{ memories_text }}"""

ANSWER = """\
{{ additional_context }}
Core Memory (User Profile):
{{ core_memory }}

Retrieved Memories:
{% for memory in memories %}{{ loop.index }}. {{ memory }}
{% endfor %}
{% if chunk_context %}Supporting Original Conversations:
{{ chunk_context }}

{% endif %}The current date/time is {{ current_time }}. Use this as the reference point
when answering questions about relative time.

Question: {{ question }}

Instructions:
1. Carefully analyze the retrieved memories to find relevant information.
2. Consider synonyms and related concepts.
3. If memories mention specific dates/times, use those for time questions.
4. If memories contain contradictory information, prefer the most recent.
5. Focus on memory content, not exact word matches.

For factual questions (What/When/Where/Who):
- Answer based on direct information in the memories.
- If the specific fact is not mentioned, respond: "Not answerable".

For inference/reasoning questions (Would/Could/Likely):
- Make reasonable inferences based on related information.

When to say "Not answerable":
- The question asks about a DIFFERENT person than the memories describe.
- The event/action is NOT mentioned in ANY memory.
- The retrieved information is about a similar but DIFFERENT event.

Provide a concise, direct answer or state "Not answerable"."""

JUDGE = """\
Your task is to label an answer to a question as 'CORRECT' or 'WRONG'.
You will be given:
(1) a question (posed by one user to another user),
(2) a 'gold' (ground truth) answer,
(3) a generated answer
which you will score as CORRECT/WRONG.

The gold answer will usually be a concise short answer that includes the
referenced topic. The generated answer might be much longer; be generous
-- as long as it touches on the same topic as the gold answer, count it
as CORRECT.

For time-related questions: as long as the generated answer refers to
the same date/period as the gold answer (even if format differs, e.g.,
"May 7th" vs "7 May"), count it as CORRECT.

Handling "Not answerable" cases:
1. GOLD = "Not answerable":
The generated answer is CORRECT if it indicates unavailability via
any equivalent phrasing ("no information", "cannot be determined").
2. GOLD is a SPECIFIC answer:
A generated "Not answerable" is WRONG.
If the answer attributes the correct fact to the WRONG person/entity,
it is also WRONG.
3. CRITICAL: "Not answerable" can ONLY be CORRECT when GOLD is also
"Not answerable". Do NOT be misled by reasoning -- focus on whether
the answer actually provides the requested information.

Question: {{ question }}
Gold answer: {{ gold_answer }}
Generated answer: {{ generated_answer }}

First provide a one-sentence explanation, then return the label as JSON:
{"label": "CORRECT" | "WRONG"}"""

TEMPLATES: dict[str, str] = {
    "core_agent": CORE_AGENT,                  # Listing 1
    "episodic_agent": EPISODIC_AGENT,          # Listing 2
    "semantic_agent": SEMANTIC_AGENT,          # Listing 3
    "procedural_agent": PROCEDURAL_AGENT,      # Listing 4
    "core_compression": CORE_COMPRESSION,      # Listing 5
    "policy_system": POLICY_SYSTEM,            # Listing 6
    "policy_user": POLICY_USER,                # Listing 7
    "user_profile": USER_PROFILE,              # Listing 8
    "merge_summary": MERGE_SUMMARY,            # Listing 9
    "answer": ANSWER,                          # Listing 10
    "judge": JUDGE,                            # Listing 11
}

_ENV = jinja2.Environment(undefined=jinja2.StrictUndefined,
                          keep_trailing_newline=False, autoescape=False)


@functools.cache
def _compiled(name: str) -> jinja2.Template:
  if name not in TEMPLATES:
    raise KeyError(f"unknown template {name!r}; known: {sorted(TEMPLATES)}")
  return _ENV.from_string(TEMPLATES[name])


def render_template(name: str, **values: object) -> str:
  """Fills template `name` (a key of `TEMPLATES`); missing values raise."""
  return _compiled(name).render(**values)
