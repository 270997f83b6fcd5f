"""A model-free memory policy that stores the user's own sentences.

Every benchmark has user turns, unlike LoCoMo's annotations
(`memory.annotations`), so this teacher works on any dataset, the bundled
sample included: `make demo` warm-starts SmolLM2-135M on it, which then
writes entries that carry its session's content instead of the fragments
an untrained 135M model writes. It is also a floor a learned policy should
beat: it keeps what the user said and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from cmimem_jax.data.fragments import stated_sentences
from cmimem_jax.data.types import Session
from cmimem_jax.memory.dsl import clean_field
from cmimem_jax.memory.types import Action, MemoryType, Operation

# Whether a response of these operations is short enough (e.g. the
# rollout's token budget); None: no limit.
ResponseFits = Callable[[Sequence[Operation]], bool]


def extractive_operations(session: Session, fits: ResponseFits | None = None
                          ) -> list[Operation]:
  """DSL operations that keep `session`'s user statements verbatim.

  CORE appends the first statement (who the user is, what they are doing);
  EPISODIC adds each later one, dated, in order, while `fits` accepts the
  response; SEMANTIC and PROCEDURAL skip. Each entry's provenance is the
  turn it was copied from. A session where the user states nothing gets
  `CORE:APPEND|Talked on DATE.` and skips the rest, so the response is
  always valid.
  """
  date = session.date.strftime("%Y-%m-%d") if session.date else "unknown"
  statements = [(turn.turn_id, clean_field(sentence))
                for turn in session.turns if turn.role == "user"
                for sentence in stated_sentences(turn.text)]
  skips = [Operation(t, Action.SKIP) for t in
           (MemoryType.SEMANTIC, MemoryType.PROCEDURAL)]
  if not statements:
    return [Operation(MemoryType.CORE, Action.APPEND, (f"Talked on {date}.",)),
            Operation(MemoryType.EPISODIC, Action.SKIP), *skips]
  (first_turn, first), *rest = statements
  core = Operation(MemoryType.CORE, Action.APPEND, (first,),
                   turn_ids=(first_turn,))
  episodic: list[Operation] = []
  for turn_id, sentence in rest:
    candidate = Operation(MemoryType.EPISODIC, Action.ADD,
                          (f"{date}: {sentence}",), turn_ids=(turn_id,))
    if fits is not None and not fits([core, *episodic, candidate, *skips]):
      break
    episodic.append(candidate)
  return [core, *(episodic or [Operation(MemoryType.EPISODIC, Action.SKIP)]),
          *skips]
