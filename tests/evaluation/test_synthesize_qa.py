"""tools/synthesize_qa.py against the loopback server."""

import json
import os
import re
import sys

import pytest

from cmimem_jax.data import bundled_path, load_dataset

from fake_openai import FakeOpenAI  # noqa: I100

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..",
                                "tools"))
import synthesize_qa  # noqa: E402


def qa_reply(content: str) -> str:
  index = re.search(r"Session (\d+) \(", content).group(1)
  if index == "2":
    return "Sorry, I cannot help with that."  # Not JSON: a failed session.
  return "```json\n" + json.dumps({"pairs": [
      {"question": f"What happened in session {index}?", "answer": "a walk",
       "type": "single-session"},
      {"question": "When?", "answer": "in March", "type": "temporal"},
      {"question": "", "answer": "dropped: empty question"},
      {"question": "Which pet?", "answer": "a dog", "type": "odd-type"},
  ]}) + "\n```"


def _dialogues(tmp_path):
  """Two bundled dialogues without their QA pairs: (file, records)."""
  source = tmp_path / "dialogues.json"
  records = json.load(open(bundled_path()))[:2]
  for record in records:
    record.pop("session_qa")
  source.write_text(json.dumps(records))
  return source, records


def test_synthesizes_session_qa_and_counts_failures(tmp_path):
  source, records = _dialogues(tmp_path)
  with FakeOpenAI(reply=qa_reply) as server:
    stats = synthesize_qa.main([f"--input={source}", "--model=fake",
                                f"--base_url={server.base_url}",
                                "--per_session=5"])
  sessions = sum(len(r["haystack_sessions"]) for r in records)
  assert stats["failed_sessions"] == 2  # Session 2 of both dialogues.
  assert stats["sessions"] == sessions - 2 and stats["pairs"] == 3 * (
      sessions - 2)
  output = tmp_path / "dialogues_qa.json"
  assert stats["output"] == str(output)
  # The written file loads as training data with the new QA pairs.
  dialogues = load_dataset("longmemeval", str(output))
  first = dialogues[0]
  session_qa = [q for q in first.questions if q.category != "knowledge-update"]
  assert {q.category for q in session_qa} == {"single-session", "temporal"}
  assert len(session_qa) == 3 * (len(first.sessions) - 1)


def test_max_tokens_fits_a_capped_server_and_nothing_synthesized_fails(
    tmp_path, capsys):
  """Against a server capped at 512 tokens the default budget (1024) gets
  a 400 for every session: the run exits non-zero with one line and
  writes nothing; --max_tokens=512 synthesizes."""
  source, _ = _dialogues(tmp_path)
  with FakeOpenAI(reply=qa_reply, max_tokens_cap=512) as server:
    flags = [f"--input={source}", "--model=fake",
             f"--base_url={server.base_url}"]
    with pytest.raises(SystemExit) as failed:
      synthesize_qa.main(flags)
    assert not (tmp_path / "dialogues_qa.json").exists()
    stats = json.loads(capsys.readouterr().out)  # Still counted.
    assert stats["failed_calls"] == {"http_4xx": stats["failed_sessions"]}
    stats = synthesize_qa.main(flags + ["--max_tokens=512"])
  message = failed.value.code
  assert isinstance(message, str) and "\n" not in message
  assert message.startswith("error: no QA pairs synthesized")
  assert "http_4xx" in message and "--max_tokens=1024" in message
  assert stats["pairs"] > 0 and "http_4xx" not in stats["failed_calls"]
