"""Files the jobs write and read back: JSONL logs that survive a hard kill,
and ids from dataset files turned into safe directory names.

A process killed mid-write leaves at most one torn (unterminated) line at
the end of an append-only JSONL file; `read_jsonl` drops it and truncates
the file back to its last complete line, so the next append starts clean.
A malformed line anywhere else is real corruption and raises.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Any

from absl import logging

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def read_jsonl(path: str, repair: bool = True) -> list[dict[str, Any]]:
  """Every record of a JSONL file ([] if it does not exist).

  Args:
    path: the file.
    repair: truncate a torn last line away (with a warning), so later
      appends produce a readable file.

  Raises:
    ValueError: a malformed line before the last one (names file and line).
  """
  if not os.path.exists(path):
    return []
  with open(path, "rb") as f:
    data = f.read()
  lines = data.split(b"\n")
  records = []
  for number, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      records.append(json.loads(line))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      if number < len(lines):  # Newline-terminated: not a torn write.
        raise ValueError(f"{path}:{number}: malformed record: {e}") from e
      logging.warning("%s: dropping a torn last line of %d bytes (a "
                      "killed writer)", path, len(line))
      if repair:
        with open(path, "r+b") as f:
          f.truncate(len(data) - len(line))
  return records


def rewrite_jsonl(path: str, records: list[dict[str, Any]]) -> None:
  """Replaces a JSONL file atomically with `records`."""
  staging = f"{path}.tmp"
  with open(staging, "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)
    f.flush()
    os.fsync(f.fileno())
  os.replace(staging, path)


def safe_name(identifier: str) -> str:
  """A file name for an id from a dataset: itself when it is made of
  `[A-Za-z0-9._-]`, at most 64 characters (and not "", "." or ".."), else
  a cleaned prefix plus a hash of the id (distinct ids stay distinct)."""
  if (identifier not in ("", ".", "..") and len(identifier) <= 64
      and not _UNSAFE.search(identifier)):
    return identifier
  digest = hashlib.sha256(identifier.encode()).hexdigest()[:12]
  cleaned = _UNSAFE.sub("_", identifier).strip(".")[:48]
  return f"{cleaned}-{digest}" if cleaned else digest


def path_under(root: str, *names: str) -> str:
  """`root/<safe names...>`, checked to resolve inside `root`."""
  path = os.path.join(root, *(safe_name(n) for n in names))
  real_root = os.path.realpath(root)
  if os.path.commonpath([real_root, os.path.realpath(path)]) != real_root:
    raise ValueError(f"{path} resolves outside {root}")
  return path
