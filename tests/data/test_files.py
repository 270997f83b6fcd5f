"""Torn JSONL tails, atomic rewrites and safe names for dataset ids."""

import os

import pytest

from cmimem_jax.data import path_under, read_jsonl, rewrite_jsonl, safe_name


def test_a_torn_last_line_is_dropped_and_cut_from_the_file(tmp_path):
  path = str(tmp_path / "log.jsonl")
  with open(path, "w") as f:
    f.write('{"a": 1}\n{"a": 2}\n{"a": 3, "tor')  # Killed mid-write.
  assert read_jsonl(path) == [{"a": 1}, {"a": 2}]
  with open(path, "a") as f:  # The next run appends...
    f.write('{"a": 4}\n')
  assert read_jsonl(path) == [{"a": 1}, {"a": 2}, {"a": 4}]  # ...cleanly.


def test_a_malformed_middle_line_is_corruption_and_raises(tmp_path):
  path = str(tmp_path / "log.jsonl")
  with open(path, "w") as f:
    f.write('{"a": 1}\n{oops\n{"a": 3}\n')
  with pytest.raises(ValueError, match=r"log.jsonl:2: malformed record"):
    read_jsonl(path)


def test_missing_file_and_rewrite(tmp_path):
  path = str(tmp_path / "log.jsonl")
  assert read_jsonl(path) == []
  rewrite_jsonl(path, [{"step": 1}, {"step": 2}])
  assert read_jsonl(path) == [{"step": 1}, {"step": 2}]
  assert not os.path.exists(path + ".tmp")


@pytest.mark.parametrize("identifier", ["", ".", "..", "../venv", "a/b",
                                        "conv:1", "x" * 300, "..\\x"])
def test_unsafe_ids_become_distinct_plain_names(identifier):
  name = safe_name(identifier)
  assert name not in ("", ".", "..") and "/" not in name and "\\" not in name
  assert len(name) <= 64 and safe_name(identifier + "!") != name


def test_safe_ids_are_kept_and_paths_stay_under_their_root(tmp_path):
  assert safe_name("conv-26") == "conv-26"
  root = str(tmp_path / "banks")
  for identifier in ("..", "../../etc", "/abs", ""):
    path = path_under(root, "policy", identifier)
    assert os.path.dirname(path) == os.path.join(root, "policy")
