"""The demo's report: the memory a response writes for a session, as
entries a person can read, and the reward table."""

from cmimem_jax.config import memory_defaults
from cmimem_jax.encoders import HashingEncoder
from cmimem_jax.memory import MemoryBank
from cmimem_jax.memory.builder import MemoryConfig
from cmimem_jax.task.episode import Episode
from cmimem_jax.task.report import (reward_table, session_line,
                                    summary_text, written_memory)

ENCODER = HashingEncoder(64)
MEMORY = MemoryConfig.from_config(memory_defaults())
RESPONSE = ("CORE:APPEND|Caroline is a counsellor\n"
            "EPISODIC:ADD|Caroline went to an LGBTQ support group on 7 May\n"
            "SEMANTIC:SKIP\nPROCEDURAL:SKIP")
# The one CORE line a response must have, changing nothing (no occurrence).
NO_CORE_CHANGE = "CORE:REPLACE|not in the core|anything"


def _episode(dialogue):
  return Episode(dialogue, dialogue.sessions[0],
                 MemoryBank(dialogue.dialogue_id, ENCODER.dim), ())


def test_written_memory_lists_new_entries_by_type(locomo_dialogues):
  episode = _episode(locomo_dialogues[0])
  lines = written_memory(episode, RESPONSE, ENCODER, MEMORY)
  assert lines == ["+ [core] Caroline is a counsellor",
                   "+ [episodic] Caroline went to an LGBTQ support group "
                   "on 7 May"]
  # A second ADD on top: only what is new is listed; long lists are cut.
  many = "\n".join([NO_CORE_CHANGE] + [f"EPISODIC:ADD|fact number {i}"
                                    for i in range(9)]
                   + ["SEMANTIC:SKIP", "PROCEDURAL:SKIP"])
  lines = written_memory(episode, many, ENCODER, MEMORY,
                         max_lines=4)
  assert lines[:4] == [f"+ [episodic] fact number {i}" for i in range(4)]
  assert lines[4] == "  … and 5 more"


def test_skip_only_and_invalid_responses_say_so(locomo_dialogues):
  episode = _episode(locomo_dialogues[0])
  skip = f"{NO_CORE_CHANGE}\nEPISODIC:SKIP\nSEMANTIC:SKIP\nPROCEDURAL:SKIP"
  assert written_memory(episode, skip, ENCODER, MEMORY) == [
      "(nothing new)"]
  (line,) = written_memory(episode, "EPISODIC:FLY|x", ENCODER,
                           MEMORY)
  assert line.startswith("(invalid response, memory unchanged: ")


def test_summary_has_the_reward_table_and_the_session(locomo_dialogues):
  episode = _episode(locomo_dialogues[0])
  history = [{"step": 1, "reward_mean": 0.5, "reward_group_std": 0.1,
              "reward/cmi": 0.2, "reward/qa": 0.3, "validity_rate": 1.0,
              "loss": None}]
  table = reward_table(history)
  assert table[0].split() == ["step", "reward", "group", "spread", "cmi",
                              "qa", "valid", "loss"]
  assert table[1].split() == ["1", "0.5000", "0.1000", "0.2000", "0.3000",
                              "1.0000", "nan"]
  about = session_line(episode)
  assert about.startswith(f"{len(episode.session.turns)} turns: \"")
  text = summary_text(history, "conv-26/0", about, ["+ [core] a"], ["b"])
  assert "--- session conv-26/0 (" in text and text.endswith(
      "memory written after GRPO:\nb")
  assert "memory written before GRPO (the loaded model):\n+ [core] a" in text
