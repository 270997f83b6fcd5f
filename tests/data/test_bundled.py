"""The bundled training samples (`bundled_path`)."""

import json
import re

from cmimem_jax.data import load_longmemeval
from cmimem_jax.data.fragments import user_statements
from cmimem_jax.data.registry import bundled_path

FILLER_SAMPLE = "longmemeval_train_with_filler.json"
FILLER_ID = re.compile(r"_f\d+$")


def _without_filler(record: dict) -> dict:
  keep = [i for i, sid in enumerate(record["haystack_session_ids"])
          if not FILLER_ID.search(sid)]
  stripped = dict(record)
  for field in ("haystack_session_ids", "haystack_dates", "haystack_sessions"):
    stripped[field] = [record[field][i] for i in keep]
  stripped["session_qa"] = {sid: qa for sid, qa in record["session_qa"].items()
                            if not FILLER_ID.search(sid)}
  return stripped


def test_the_filler_sample_is_the_base_sample_plus_sessions_stating_nothing():
  with open(bundled_path()) as f:
    base = json.load(f)
  with open(bundled_path(FILLER_SAMPLE)) as f:
    filler = json.load(f)
  # Nothing of the base sample changed: the runs on either are comparable.
  assert [_without_filler(r) for r in filler] == base
  dialogues = load_longmemeval(bundled_path(FILLER_SAMPLE))
  kinds = {}
  for dialogue in dialogues:
    dates = [s.date for s in dialogue.sessions]
    assert dates == sorted(dates), dialogue.dialogue_id
    for session in dialogue.sessions:
      is_filler = bool(FILLER_ID.search(session.session_id))
      kinds[session.session_id] = is_filler
      # Filler sessions are exactly those where the user states nothing
      # (the semantic-SKIP judgement's ρ = 0).
      assert is_filler == (not user_statements(session.user_turns())), (
          session.session_id)
  assert sum(kinds.values()) == 12 and len(kinds) == 27
  # Every filler QA pair is answered by the session's own words.
  texts = {s.session_id: " ".join(t.text for t in s.turns).lower()
           for d in dialogues for s in d.sessions}
  filler_qa = [(sid, pair) for r in filler
               for sid, pairs in r["session_qa"].items() if kinds[sid]
               for pair in pairs]
  assert len(filler_qa) == 24
  for sid, pair in filler_qa:
    assert pair["answer"].lower() in texts[sid], (sid, pair)
