"""tools/synthesize_qa.py against the loopback server."""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from cmimem_jax.data import bundled_path, load_dataset
from cmimem_jax.memory.bank import MemoryBank
from cmimem_jax.memory.types import MemoryEntry, MemoryType
from cmimem_jax.task import qa_synthesis
from cmimem_jax.task.snapshots import STATES_FILE, save_snapshots
from cmimem_jax.testing import run_tool
from cmimem_jax.testing.fake_openai import FakeOpenAI
from tools import synthesize_qa

ROOT = pathlib.Path(__file__).resolve().parents[2]


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


def test_synthesizes_session_qa_and_counts_failures(tmp_path, capsys):
  source, records = _dialogues(tmp_path)
  sessions = sum(len(r["haystack_sessions"]) for r in records)
  output = tmp_path / "dialogues_qa.json"
  flags = [f"--input={source}", "--model=fake", "--per_session=5"]
  with FakeOpenAI(reply=qa_reply) as server:
    # Session 2 of both dialogues fails: more than the rate accepted by
    # default (0), so nothing is written, the endpoint and count named.
    with pytest.raises(SystemExit) as failed:
      run_tool(synthesize_qa, flags + [f"--base_url={server.base_url}"])
    message = failed.value.code
    assert message.startswith(f"error: 2 of {sessions} sessions failed")
    assert server.base_url in message and "\n" not in message
    assert "2 answers without JSON pairs" in message
    assert not output.exists()
    capsys.readouterr()
    # Accepting the rate: the rerun asks only for the failed sessions.
    asked = server.requests
    stats = run_tool(synthesize_qa, flags + [f"--base_url={server.base_url}",
                                             "--max_failure_rate=0.5"])
    assert server.requests - asked == 2 and stats["calls"] == 2
  # Without --expert_states: our prompt over the earlier sessions.
  assert all(p.startswith(qa_synthesis.PROMPT.split("\n")[0])
             for p in server.attempts)
  assert stats["failed_sessions"] == 2  # Session 2 of both dialogues.
  assert stats["kept_from_earlier_runs"] == sessions - 2
  assert stats["sessions"] == sessions - 2 and stats["pairs"] == 3 * (
      sessions - 2)
  assert stats["output"] == str(output)
  # The written file loads as training data with the new QA pairs.
  dialogues = load_dataset("longmemeval", str(output))
  first = dialogues[0]
  session_qa = [q for q in first.questions if q.category != "knowledge-update"]
  assert {q.category for q in session_qa} == {"single-session", "temporal"}
  assert len(session_qa) == 3 * (len(first.sessions) - 1)


def test_an_interrupted_run_resumes_with_only_the_remaining_calls(
    tmp_path, capsys):
  """SIGTERM after k sessions: one line says what was kept, the exit is
  143; the rerun asks only for the other sessions and writes what an
  uninterrupted run writes."""
  source, records = _dialogues(tmp_path)
  sessions = sum(len(r["haystack_sessions"]) for r in records)
  reply = lambda content: qa_reply(content.replace("Session 2 (",  # noqa
                                                   "Session 9 ("))
  flags = [f"--input={source}", "--model=fake", "--concurrency=1"]
  with FakeOpenAI(reply=reply) as server:
    whole = run_tool(synthesize_qa, flags + [
        f"--base_url={server.base_url}", f"--output={tmp_path / 'whole.json'}"])
  assert whole["sessions"] == sessions
  k = 3

  def stop_after_k(content):
    if server.requests == k:
      os.kill(os.getpid(), signal.SIGTERM)
    return reply(content)
  resumed = tmp_path / "resumed.json"
  with FakeOpenAI(reply=stop_after_k) as server:
    with pytest.raises(SystemExit) as stopped:
      run_tool(synthesize_qa, flags + [f"--base_url={server.base_url}",
                                       f"--output={resumed}"])
    assert stopped.value.code == 128 + signal.SIGTERM
    assert server.requests == k and not resumed.exists()
    line = capsys.readouterr().err.strip()
    assert line == (f"stopped by SIGTERM: {k} of {sessions} sessions' pairs "
                    f"kept in {resumed}.progress.jsonl; rerun the same "
                    "command to continue")
    server.reply = reply
    rerun = run_tool(synthesize_qa, flags + [f"--base_url={server.base_url}",
                                             f"--output={resumed}"])
  assert server.requests == sessions  # k before the stop, the rest now.
  assert rerun["calls"] == sessions - k
  assert rerun["kept_from_earlier_runs"] == k
  assert resumed.read_text() == (tmp_path / "whole.json").read_text()


@pytest.mark.slow
def test_ctrl_c_of_the_command_prints_one_line_and_keeps_the_pairs(
    tmp_path):
  """The command itself (a subprocess): Ctrl-C while calls are answered
  prints one line, no traceback, and exits 130; what was answered is in
  the progress file."""
  source, records = _dialogues(tmp_path)
  output = tmp_path / "out.json"
  started = threading.Event()

  def slow(content):
    started.set()
    time.sleep(0.3)
    return qa_reply(content)
  with FakeOpenAI(reply=slow) as server:
    process = subprocess.Popen(
        [sys.executable, "-m", "tools.synthesize_qa", f"--input={source}",
         "--model=fake", "--concurrency=1", f"--base_url={server.base_url}",
         f"--output={output}"], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert started.wait(60)
    time.sleep(0.5)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=60)
  assert process.returncode == 128 + signal.SIGINT, err
  assert "Traceback" not in err
  line = err.strip().splitlines()[-1]
  assert re.fullmatch(r"stopped by SIGINT: \d+ of \d+ sessions' pairs kept "
                      r"in .*out\.json\.progress\.jsonl; rerun the same "
                      "command to continue", line), err
  kept = int(line.split(": ")[1].split()[0])
  assert kept >= 1
  assert len((tmp_path / "out.json.progress.jsonl").read_text().splitlines()
             ) == 1 + kept  # The settings line, then one per session.
  assert not output.exists()


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
      run_tool(synthesize_qa, flags)
    assert not (tmp_path / "dialogues_qa.json").exists()
    stats = json.loads(capsys.readouterr().out)  # Still counted.
    assert stats["failed_calls"] == {"http_4xx": stats["failed_sessions"]}
    stats = run_tool(synthesize_qa, flags + ["--max_tokens=512",
                                             "--max_failure_rate=0.5"])
  message = failed.value.code
  assert isinstance(message, str) and "\n" not in message
  assert message.startswith("error: no QA pairs synthesized")
  assert "http_4xx" in message and "--max_tokens=1024" in message
  assert stats["pairs"] > 0 and "http_4xx" not in stats["failed_calls"]


CORE, EPISODE, FACT = ("Name: Rin. Lives in Osaka.",
                       "2023-05-01: adopted a beagle named Biscuit",
                       "Rin prefers green tea")


def _expert_states(directory, records) -> None:
  """States as tools/build_expert_states.py saves them: s0 empty, every
  later session's state holds CORE, EPISODE and FACT."""
  banks = []
  for record in records:
    bank = MemoryBank(record["question_id"], dim=4)
    per_record = [bank.copy()]
    bank.core = CORE
    for i, (kind, text) in enumerate([(MemoryType.EPISODIC, EPISODE),
                                      (MemoryType.SEMANTIC, FACT)]):
      bank.stores[kind].add(MemoryEntry(f"e{i}", kind, text, 1, 1, 0),
                            np.ones(4, np.float32))
    per_record += [bank] * (len(record["haystack_sessions"]) - 1)
    banks.append(per_record)
  save_snapshots(str(directory), banks)
  (directory / STATES_FILE).write_text("{}")


def membuilder_reply(content: str) -> str:
  """MemBuilder's answer format (`questions`, `temporal-reasoning`)."""
  return json.dumps({"questions": [
      {"question": "What is my dog's name?", "answer": "Biscuit",
       "type": "single-session", "source": "current_session"},
      {"question": "When did I adopt my dog?", "answer": "2023-05-01",
       "type": "temporal-reasoning", "source": "cross_session"}]})


def test_expert_states_condition_the_prompt_on_the_memory_state(tmp_path):
  """With --expert_states each session's prompt is MemBuilder's, holding
  that session's state (core and every entry); its answer format loads."""
  source, records = _dialogues(tmp_path)
  _expert_states(tmp_path / "states", records)
  with FakeOpenAI(reply=membuilder_reply) as server:
    stats = run_tool(synthesize_qa, [
        f"--input={source}", "--model=fake", f"--base_url={server.base_url}",
        "--per_session=2", f"--expert_states={tmp_path / 'states'}"])
  prompts = list(server.attempts)
  sessions = sum(len(r["haystack_sessions"]) for r in records)
  assert len(prompts) == sessions and stats["pairs"] == 2 * sessions
  assert all(p.startswith(qa_synthesis.MEMORY_PROMPT.split("\n")[0])
             and "Generate exactly 2 questions" in p for p in prompts)
  with_state = [p for p in prompts
                if f"Core Memory:\n{CORE}\n" in p
                and f"\n{EPISODE}\n" in p and f"\n{FACT}\n" in p]
  empty = [p for p in prompts if "Core Memory:\n[Empty]\n" in p]
  assert len(with_state) == sessions - 2 and len(empty) == 2  # s0 of each.
  # The session itself and its date follow the state.
  first = records[0]
  session_1 = qa_synthesis.session_text(first["haystack_sessions"][1])
  assert any(f"(Newly Added):**\n{session_1}\n\nSession Timestamp: "
             f"{first['haystack_dates'][1]}\n" in p for p in with_state)
  qa = json.load(open(tmp_path / "dialogues_qa.json"))[0]["session_qa"]
  assert {p["type"] for pairs in qa.values() for p in pairs} == {
      "single-session", "temporal"}


def test_missing_expert_states_fail_in_one_line(tmp_path):
  source, records = _dialogues(tmp_path)
  _expert_states(tmp_path / "states", records[:1])  # Second record lacks.
  with pytest.raises(SystemExit) as failed:
    run_tool(synthesize_qa, [f"--input={source}", "--model=fake",
                             f"--expert_states={tmp_path / 'states'}"])
  message = failed.value.code
  assert "session states missing" in message and "\n" not in message
  assert records[1]["question_id"] in message
