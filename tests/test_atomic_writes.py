"""Every final output of the project is written atomically, through ONE
helper (`cmimem_jax.storage.write_atomic`, re-exported by
`cmimem_jax.data.files`: temp file + fsync + rename; a whole object on GCS):
a kill or a full disk leaves the old file or the new one, never a torn
one. An AST scan of `cmimem_jax/` and `tools/` finds any other write of a
whole file (`open(..., "w"/"x")`, `os.fdopen(..., "w")`,
`Path.write_text` / `write_bytes`, `savefig(path)`) outside a short,
justified allow-list. Appending (`"a"`: JSONL logs that survive a kill by
design, `data.files.read_jsonl`) is not a final write."""

import ast
import errno
import os
import pathlib

import pytest

from cmimem_jax.data.files import write_atomic

ROOT = pathlib.Path(__file__).resolve().parent.parent

# (file, enclosing function): why its whole-file write is not a result file
# or is atomic by other means.
ALLOWED = {
    # The helper itself (`storage.write_atomic`'s local path).
    ("cmimem_jax/storage.py", "_write_local_atomic"),
    # Create-if-absent (the workdir lock): O_CREAT | O_EXCL locally, its
    # creation is the atomic step, and a torn lock reads as nobody's.
    ("cmimem_jax/storage.py", "create_new"),
    # An append-only file (metrics.jsonl, rollouts.jsonl, TensorBoard):
    # records are appended and flushed, never rewritten in place.
    ("cmimem_jax/storage.py", "__init__"),
    # The GCS emulator's own log (a test fixture's process): not a result.
    ("cmimem_jax/testing/gcs_emulator.py", "__init__"),
    # A bank's files are written into a staging folder that is renamed
    # into place whole (`MemoryBank.save`: one atomic version per save).
    ("cmimem_jax/memory/bank.py", "_write_file"),
    # A subprocess's log, streamed while it runs: not a result.
    ("tools/rehearse.py", "_run"),
    ("tools/rehearse.py", "serve_start"),
    ("tools/rehearse.py", "train"),
}

_OPENERS = {"open", "fdopen"}
_WHOLE_FILE_METHODS = {"write_text", "write_bytes", "savefig"}


def _mode(call: ast.Call) -> str | None:
  """The constant mode of an `open` / `fdopen` call ("r" when absent)."""
  for keyword in call.keywords:
    if keyword.arg == "mode":
      value = keyword.value
      return value.value if isinstance(value, ast.Constant) else "?"
  if len(call.args) >= 2:
    value = call.args[1]
    return value.value if isinstance(value, ast.Constant) else "?"
  return "r"


def _name(func: ast.expr) -> str:
  if isinstance(func, ast.Name):
    return func.id
  if isinstance(func, ast.Attribute):
    return func.attr
  return ""


def _to_memory(call: ast.Call) -> bool:
  """`fig.savefig(buffer, ...)` into an in-memory buffer (a Name other
  than a path) is how a figure reaches `write_atomic`."""
  first = call.args[0] if call.args else None
  return isinstance(first, ast.Name) and first.id in ("buffer", "png")


def whole_file_writes(path: pathlib.Path) -> list[tuple[int, str, str]]:
  """(line, enclosing function, what) of each whole-file write in `path`."""
  tree = ast.parse(path.read_text(), str(path))
  found = []

  def visit(node: ast.AST, function: str) -> None:
    for child in ast.iter_child_nodes(node):
      inner = (child.name if isinstance(
          child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function)
      if isinstance(child, ast.Call):
        name = _name(child.func)
        # `os.open`'s flags are not a mode; a descriptor it opens is
        # written through `os.fdopen`, which is checked.
        low_level = (isinstance(child.func, ast.Attribute) and name == "open"
                     and _name(child.func.value) == "os")
        if name in _OPENERS and not low_level:
          mode = _mode(child)
          if mode == "?" or any(m in mode for m in "wx"):
            found.append((child.lineno, function, f"{name}(..., {mode!r})"))
        elif name in _WHOLE_FILE_METHODS and not _to_memory(child):
          found.append((child.lineno, function, f".{name}(...)"))
      visit(child, inner)

  visit(tree, "<module>")
  return found


def scanned_files() -> list[pathlib.Path]:
  return sorted([*(ROOT / "cmimem_jax").rglob("*.py"),
                 *(ROOT / "tools").glob("*.py")])


def test_final_writes_go_through_write_atomic():
  offenders, used = [], set()
  for path in scanned_files():
    relative = path.relative_to(ROOT).as_posix()
    for line, function, what in whole_file_writes(path):
      if (relative, function) in ALLOWED:
        used.add((relative, function))
      else:
        offenders.append(f"{relative}:{line} in {function}: {what}")
  assert not offenders, (
      "whole-file writes outside cmimem_jax.storage.write_atomic "
      "(write the bytes with it, or justify the write in ALLOWED):\n  "
      + "\n  ".join(offenders))
  assert used == ALLOWED, f"stale allow-list entries: {ALLOWED - used}"


def test_the_scan_finds_a_plain_write(tmp_path):
  """The scanner sees the forms it forbids (a scan that finds nothing
  would pass on anything)."""
  source = tmp_path / "sample.py"
  source.write_text(
      "import json, os\n"
      "def save(path, fig, fd):\n"
      "  with open(path, 'w') as f:\n"
      "    json.dump({}, f)\n"
      "  open(path, mode='xb')\n"
      "  os.fdopen(fd, 'wb')\n"
      "  path.write_text('x')\n"
      "  fig.savefig(path)\n"
      "  open(path, 'a')\n"
      "  open(path)\n"
      "  fig.savefig(buffer, format='png')\n")
  assert [(line, what.split("(")[0]) for line, _, what in
          whole_file_writes(source)] == [
              (3, "open"), (5, "open"), (6, "fdopen"), (7, ".write_text"),
              (8, ".savefig")]


def test_write_atomic_replaces_whole_or_not_at_all(tmp_path, monkeypatch):
  path = tmp_path / "results.json"
  write_atomic(str(path), "old")
  write_atomic(str(path), b"new bytes")
  assert path.read_bytes() == b"new bytes"
  assert oct(path.stat().st_mode & 0o777) == oct(0o644)
  # A full disk found when the data is flushed: the old file stays, no
  # temporary is left.

  def full(fd):
    raise OSError(errno.ENOSPC, "No space left on device")
  monkeypatch.setattr(os, "fsync", full)
  with pytest.raises(OSError, match="No space"):
    write_atomic(str(path), "x" * 100_000)
  monkeypatch.undo()
  assert path.read_bytes() == b"new bytes"
  assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]
