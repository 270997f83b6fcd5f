import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from cmimem_jax.memory import (Action, MemoryBank, MemoryType, Operation,
                               apply_operations)


def _filled_bank(encoder, n=30):
  bank = MemoryBank("user-ü", encoder.dim)
  ops = [Operation(MemoryType.CORE, Action.APPEND, ("Name: Zoë 🙂",))]
  ops += [Operation(t, Action.ADD, (f"{t.value} fact {i} about tea",))
          for i in range(n) for t in (MemoryType.EPISODIC, MemoryType.SEMANTIC)]
  bank, _ = apply_operations(bank, ops, encoder, session_index=2,
                             turn_ids=("D1:1", "D1:2"))
  bank, _ = apply_operations(bank, [Operation(
      MemoryType.EPISODIC, Action.MERGE,
      ("episodic fact 0 about tea", "episodic fact 1 about tea", "timeline"))],
      encoder, session_index=3)
  return bank


def test_save_load_round_trip(tmp_path, encoder):
  bank = _filled_bank(encoder)
  bank.save(str(tmp_path / "bank"))
  loaded = MemoryBank.load(str(tmp_path / "bank"))
  assert loaded == bank
  assert loaded.entries(MemoryType.EPISODIC)[-1].links == ("e1", "e3")
  query = encoder.encode(["fact 7 about tea"])[0]
  assert [h.entry for h in loaded.search(query, 5)] == [
      h.entry for h in bank.search(query, 5)]
  # Saving again replaces the version and keeps exactly one.
  loaded.core += "\nmore"
  loaded.save(str(tmp_path / "bank"))
  versions = [n for n in os.listdir(tmp_path / "bank") if n.startswith("v")]
  assert len(versions) == 1
  assert MemoryBank.load(str(tmp_path / "bank")).core.endswith("more")


def test_empty_bank_round_trip(tmp_path, encoder):
  bank = MemoryBank("empty", encoder.dim)
  bank.save(str(tmp_path / "b"))
  assert MemoryBank.load(str(tmp_path / "b")) == bank


def test_missing_and_inconsistent(tmp_path, encoder):
  with pytest.raises(FileNotFoundError):
    MemoryBank.load(str(tmp_path / "nothing"))
  bank = _filled_bank(encoder, n=2)
  folder = bank.save(str(tmp_path / "b"))
  with open(os.path.join(folder, "entries.jsonl")) as f:
    lines = f.readlines()
  with open(os.path.join(folder, "entries.jsonl"), "w") as f:
    f.writelines(lines[:-1])
  with pytest.raises(ValueError, match="semantic.faiss: 2 vectors"):
    MemoryBank.load(str(tmp_path / "b"))


_WRITER = textwrap.dedent("""
    import os, sys, time
    from cmimem_jax.encoders import HashingEncoder
    from cmimem_jax.memory import bank as bank_module
    from cmimem_jax.memory import MemoryBank
    target = sys.argv[1]
    bank = MemoryBank.load(target)
    bank.core = "NEW VERSION"
    real_write = bank_module._write_file
    def slow_write(path, data):
      real_write(path, data[: len(data) // 2])  # Half-written file on disk.
      print("writing", flush=True)
      time.sleep(60)
    bank_module._write_file = slow_write
    bank.save(target)
""")


def test_killed_writer_never_leaves_a_half_written_bank(tmp_path, encoder):
  bank = _filled_bank(encoder, n=5)
  target = str(tmp_path / "bank")
  bank.save(target)
  proc = subprocess.Popen([sys.executable, "-c", _WRITER, target],
                          stdout=subprocess.PIPE, text=True)
  try:
    assert proc.stdout.readline().strip() == "writing"
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  assert any(n.startswith(".tmp-") for n in os.listdir(target))
  assert MemoryBank.load(target) == bank  # The old version, intact.
  # The next save cleans the debris.
  bank.save(target)
  assert not any(n.startswith(".tmp-") for n in os.listdir(target))
  assert MemoryBank.load(target) == bank


def test_copy_is_independent(encoder):
  bank = _filled_bank(encoder, n=3)
  other = bank.copy()
  other, _ = apply_operations(other, [Operation(
      MemoryType.SEMANTIC, Action.UPDATE,
      ("semantic fact 0 about tea", "changed"))], encoder, session_index=9)
  assert bank.entries(MemoryType.SEMANTIC)[0].text == "semantic fact 0 about tea"
  assert other.entries(MemoryType.SEMANTIC)[0].text == "changed"
  assert not np.array_equal(bank.stores[MemoryType.SEMANTIC].vectors,
                            other.stores[MemoryType.SEMANTIC].vectors)


def test_recent_and_render(encoder):
  bank = _filled_bank(encoder, n=3)
  recent = bank.recent(MemoryType.EPISODIC, 2)
  assert [e.text for e in recent] == ["timeline", "episodic fact 2 about tea"]
  text = bank.render(max_entries=2)
  assert "Name: Zoë" in text and "more" in text


def test_save_deletes_only_its_own_old_versions(tmp_path, encoder):
  target = tmp_path / "shared"
  for sibling in ("venv", "v1", "vocab.txt", ".tmp-notes"):
    path = target / sibling
    path.parent.mkdir(exist_ok=True)
    path.mkdir() if "." not in sibling[1:] else path.write_text("keep")
  bank = _filled_bank(encoder, 3)
  first = bank.save(str(target))
  second = bank.save(str(target))
  left = sorted(os.listdir(target))
  assert os.path.basename(first) not in left  # The old version went...
  assert {"venv", "v1", "vocab.txt", ".tmp-notes",  # ...nothing else did.
          os.path.basename(second), "CURRENT"} == set(left)


@pytest.mark.parametrize("pointer", ["../elsewhere", "/etc", "", "v1/../.."])
def test_a_current_file_pointing_elsewhere_is_refused(tmp_path, encoder,
                                                      pointer):
  target = str(tmp_path / "b")
  _filled_bank(encoder, 2).save(target)
  with open(os.path.join(target, "CURRENT"), "w") as f:
    f.write(pointer)
  with pytest.raises(ValueError, match="is not a bank version name"):
    MemoryBank.load(target)


def test_a_failed_save_leaves_no_half_written_version(tmp_path, encoder):
  bank = _filled_bank(encoder, n=2)
  bank.save(str(tmp_path / "bank"))
  broken = _filled_bank(encoder, n=2)
  broken.core = "cannot be stored: \ud800"
  with pytest.raises(UnicodeEncodeError):
    broken.save(str(tmp_path / "bank"))
  assert not [n for n in os.listdir(tmp_path / "bank") if n.startswith(".tmp")]
  assert MemoryBank.load(str(tmp_path / "bank")) == bank


def test_conditioning_pool_is_every_entry_and_the_newest_episodes(encoder):
  bank = MemoryBank("u", encoder.dim)
  bank.core = "Name: Ana\n\n  Lives in Porto  \n"
  for step, texts in enumerate((("older trip", "older dinner"),
                                ("newest trip", "newest dinner"))):
    bank, _ = apply_operations(
        bank, [Operation(MemoryType.SEMANTIC, Action.ADD, (f"fact {step}",))]
        + [Operation(MemoryType.EPISODIC, Action.ADD, (t,)) for t in texts],
        encoder, session_index=step)
  pool = bank.conditioning_pool()
  entries = bank.entries()
  assert pool.vectors.shape == (len(entries), encoder.dim)
  for row, entry in enumerate(entries):
    typed = bank.entries(entry.memory_type)
    assert np.array_equal(pool.vectors[row], bank.vectors(entry.memory_type)[
        typed.index(entry)])
  # Newest session first; within a session, the later-written entry first.
  assert [entries[row].text for row in pool.episodic_newest] == [
      "newest dinner", "newest trip", "older dinner", "older trip"]
  assert pool.core_lines == ("Name: Ana", "Lives in Porto")
  empty = MemoryBank("u", encoder.dim).conditioning_pool()
  assert empty.vectors.shape == (0, encoder.dim) and not len(
      empty.episodic_newest) and empty.core_lines == ()
