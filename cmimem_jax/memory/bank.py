"""The four-slot memory bank (paper Eq. 1, §3.2; SPEC §3.1).

`MemoryBank` holds one user's core block and, per entry type, the entries
with their unit-norm embeddings in a FAISS inner-product index. Banks are
treated as values: `apply_operations` returns a new bank and never mutates
its input, so a failed or invalid response leaves the old bank intact.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import uuid
from collections.abc import Iterable, Sequence

import faiss
import numpy as np

from cmimem_jax import storage
from cmimem_jax.memory.types import ENTRY_TYPES, MemoryEntry, MemoryType

FORMAT_VERSION = 1
_CURRENT = "CURRENT"
# The version folders `save` writes (and the only names it ever deletes).
_VERSION = re.compile(r"v\d{6,}-[0-9a-f]{8}")


@dataclasses.dataclass(frozen=True)
class SearchHit:
  entry: MemoryEntry
  score: float  # Cosine similarity to the query.


@dataclasses.dataclass(frozen=True)
class ConditioningPool:
  """What a bank offers the CMI estimator to condition on (§3.3: all of
  `M_{t-1}`, the core block included; App. F's recency term).

  Attributes:
    vectors: `[n, dim]` float32 embeddings of every entry, entry types in
      order (rows as `MemoryBank.entries()`).
    episodic_newest: `[n_episodic]` int64 rows of `vectors` holding the
      episodic entries, newest first (by `created_step`, then position).
    core_lines: The core block's non-empty lines, stripped: each one a
      memory (the core is not indexed, so the estimator embeds them).
  """
  vectors: np.ndarray
  episodic_newest: np.ndarray
  core_lines: tuple[str, ...]


class TypedStore:
  """Entries of one memory type and their embeddings, searchable by cosine.

  Embeddings live in a FAISS `IndexFlatIP` (exact inner product over unit
  vectors = cosine). In-place updates rebuild the index lazily.
  """

  def __init__(self, dim: int):
    self.dim = dim
    self.entries: list[MemoryEntry] = []
    self._vectors = np.zeros((0, dim), np.float32)
    self._index: faiss.IndexFlatIP | None = None

  def __len__(self) -> int:
    return len(self.entries)

  @property
  def vectors(self) -> np.ndarray:
    """`[n, dim]` float32 embeddings, row i belonging to `entries[i]`."""
    return self._vectors

  def copy(self) -> TypedStore:
    other = TypedStore(self.dim)
    other.entries = list(self.entries)
    other._vectors = self._vectors  # Never written in place: see add/replace.
    return other

  def add(self, entry: MemoryEntry, vector: np.ndarray) -> None:
    self.entries.append(entry)
    self._vectors = np.concatenate(
        [self._vectors, vector.reshape(1, self.dim).astype(np.float32)])
    self._index = None

  def replace(self, position: int, entry: MemoryEntry,
              vector: np.ndarray) -> None:
    self.entries[position] = entry
    vectors = self._vectors.copy()
    vectors[position] = vector
    self._vectors = vectors
    self._index = None

  def find_exact(self, text: str) -> int | None:
    """Position of the newest entry whose text equals `text` (stripped)."""
    text = text.strip()
    for position in range(len(self.entries) - 1, -1, -1):
      if self.entries[position].text.strip() == text:
        return position
    return None

  def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k by cosine for `[m, dim]` queries -> (scores, positions) `[m, k']`.

    `k' = min(k, len(self))`; positions index `entries`.
    """
    queries = np.ascontiguousarray(queries, np.float32).reshape(-1, self.dim)
    k = min(k, len(self.entries))
    if k == 0:
      return (np.zeros((len(queries), 0), np.float32),
              np.zeros((len(queries), 0), np.int64))
    if self._index is None:
      self._index = faiss.IndexFlatIP(self.dim)
      self._index.add(self._vectors)
    return self._index.search(queries, k)


class MemoryBank:
  """One user's memory state `M = (core, episodic, semantic, procedural)`.

  Attributes:
    user_id: Owner; retrieval never crosses banks (per-user isolation).
    dim: Embedding width of the encoder that built it.
    core: The core profile block (always in the prompt, not indexed).
    step: Number of responses applied so far (the session counter `t`).
  """

  def __init__(self, user_id: str, dim: int):
    self.user_id = user_id
    self.dim = dim
    self.core = ""
    self.step = 0
    self._next_id = 0
    self.stores: dict[MemoryType, TypedStore] = {
        t: TypedStore(dim) for t in ENTRY_TYPES}

  def copy(self) -> MemoryBank:
    """A copy that shares no mutable state with this bank."""
    other = MemoryBank(self.user_id, self.dim)
    other.core = self.core
    other.step = self.step
    other._next_id = self._next_id
    other.stores = {t: s.copy() for t, s in self.stores.items()}
    return other

  def new_entry_id(self) -> str:
    self._next_id += 1
    return f"e{self._next_id}"

  def entries(self, memory_type: MemoryType | None = None
              ) -> list[MemoryEntry]:
    """Entries of one type, or of all entry types in type order."""
    if memory_type is not None:
      return list(self.stores[memory_type].entries)
    return [e for t in ENTRY_TYPES for e in self.stores[t].entries]

  def __len__(self) -> int:
    return sum(len(s) for s in self.stores.values())

  def vectors(self, memory_type: MemoryType | None = None) -> np.ndarray:
    """`[n, dim]` float32 embeddings of `entries(memory_type)`, row i
    belonging to entry i (read-only: a bank's arrays are shared by its
    copies)."""
    if memory_type is not None:
      return self.stores[memory_type].vectors
    return np.concatenate([self.stores[t].vectors for t in ENTRY_TYPES])

  def core_lines(self) -> list[str]:
    """The core block's non-empty lines, stripped."""
    return [line.strip() for line in self.core.splitlines() if line.strip()]

  def conditioning_pool(self) -> ConditioningPool:
    """The memories of this bank (as `M_{t-1}`) that a CMI conditioning set
    is drawn from (`cmi.estimator`)."""
    offset = sum(len(self.stores[t]) for t in
                 ENTRY_TYPES[:ENTRY_TYPES.index(MemoryType.EPISODIC)])
    episodic = self.stores[MemoryType.EPISODIC].entries
    newest = sorted(range(len(episodic)),
                    key=lambda i: (episodic[i].created_step, i), reverse=True)
    return ConditioningPool(self.vectors(),
                            np.asarray(newest, np.int64) + offset,
                            tuple(self.core_lines()))

  def recent(self, memory_type: MemoryType, n: int) -> list[MemoryEntry]:
    """The `n` most recently created entries of a type, newest first."""
    entries = sorted(self.stores[memory_type].entries,
                     key=lambda e: (e.created_step, int(e.entry_id[1:])))
    return entries[::-1][:n]

  def search(self, query: np.ndarray, k: int,
             types: Iterable[MemoryType] = ENTRY_TYPES) -> list[SearchHit]:
    """Top-k entries by cosine to one `[dim]` query over the given types."""
    hits = []
    for memory_type in types:
      store = self.stores[memory_type]
      scores, positions = store.search(query[None], k)
      hits.extend(SearchHit(store.entries[p], float(s))
                  for s, p in zip(scores[0], positions[0]))
    hits.sort(key=lambda h: -h.score)
    return hits[:k]

  def __eq__(self, other: object) -> bool:
    if not isinstance(other, MemoryBank):
      return NotImplemented
    return (self.user_id == other.user_id and self.dim == other.dim
            and self.core == other.core and self.step == other.step
            and self._next_id == other._next_id
            and all(self.stores[t].entries == other.stores[t].entries
                    and np.array_equal(self.stores[t].vectors,
                                       other.stores[t].vectors)
                    for t in ENTRY_TYPES))

  __hash__ = None  # Mutable container.

  def __repr__(self) -> str:
    counts = ", ".join(f"{t.value}={len(self.stores[t])}" for t in ENTRY_TYPES)
    return (f"MemoryBank(user={self.user_id!r}, step={self.step}, "
            f"core={len(self.core)} chars, {counts})")

  def render(self, max_entries: int = 10) -> str:
    """Human-readable dump for demos and debugging."""
    lines = [repr(self), "[core]"]
    lines += [f"  {line}" for line in self.core.splitlines()] or ["  (empty)"]
    for memory_type in ENTRY_TYPES:
      entries = self.stores[memory_type].entries
      lines.append(f"[{memory_type.value}] {len(entries)} entries")
      for entry in entries[:max_entries]:
        link = f" <- {','.join(entry.links)}" if entry.links else ""
        lines.append(f"  {entry.entry_id} s{entry.session_index} "
                     f"{list(entry.turn_ids)[:4]}{link}: {entry.text}")
      if len(entries) > max_entries:
        lines.append(f"  ... {len(entries) - max_entries} more")
    return "\n".join(lines)

  # --- persistence -------------------------------------------------------

  def save(self, directory: str) -> str:
    """Writes the bank atomically; returns the version folder written.

    Layout: `directory/CURRENT` names a complete version folder holding
    `meta.json`, `entries.jsonl` and one FAISS index per type. A new version
    is written in full, then `CURRENT` is switched with an atomic rename, so
    a crash at any point leaves the previous version readable. On object
    storage (no renames) the version's objects are written where they
    stay, then `CURRENT` as one whole object: the same guarantee.
    """
    if storage.is_remote(directory):
      return self._save_remote(directory)
    os.makedirs(directory, exist_ok=True)
    _remove_stale_temporaries(directory)
    version = f"v{self.step:06d}-{uuid.uuid4().hex[:8]}"
    staging = os.path.join(directory, f".tmp-{version}")
    os.makedirs(staging)
    try:
      self._write_version(staging)
    except BaseException:
      shutil.rmtree(staging, ignore_errors=True)  # Nothing half-written.
      raise
    os.rename(staging, os.path.join(directory, version))
    _write_file(os.path.join(directory, f".{_CURRENT}.tmp"), version.encode())
    os.replace(os.path.join(directory, f".{_CURRENT}.tmp"),
               os.path.join(directory, _CURRENT))
    _fsync_dir(directory)
    for name in os.listdir(directory):
      if _VERSION.fullmatch(name) and name != version:
        shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    return os.path.join(directory, version)

  def _save_remote(self, directory: str) -> str:
    version = f"v{self.step:06d}-{uuid.uuid4().hex[:8]}"
    folder = storage.join(directory, version)
    self._write_version(folder)
    storage.write_atomic(storage.join(directory, _CURRENT), version)
    for child in storage.path(directory).iterdir():
      # Older versions, and any a crashed save left unnamed.
      if _VERSION.fullmatch(child.name) and child.name != version:
        child.rmtree()
    return folder

  def _write_version(self, staging: str) -> None:
    """The files of one version, in `staging`."""
    meta = {"format_version": FORMAT_VERSION, "user_id": self.user_id,
            "dim": self.dim, "core": self.core, "step": self.step,
            "next_id": self._next_id}
    _write_file(storage.join(staging, "meta.json"),
                json.dumps(meta, ensure_ascii=False).encode())
    rows = (json.dumps(_entry_to_json(e), ensure_ascii=False)
            for e in self.entries())
    _write_file(storage.join(staging, "entries.jsonl"),
                "".join(f"{r}\n" for r in rows).encode())
    for memory_type in ENTRY_TYPES:
      index = faiss.IndexFlatIP(self.dim)
      index.add(self.stores[memory_type].vectors)
      _write_file(storage.join(staging, f"{memory_type.value}.faiss"),
                  faiss.serialize_index(index).tobytes())
    _fsync_dir(staging)

  @classmethod
  def load(cls, directory: str) -> MemoryBank:
    """Loads the version `directory/CURRENT` points to.

    Raises:
      FileNotFoundError: no saved bank in `directory`.
      ValueError: the saved files are inconsistent (names the file).
    """
    current = storage.join(directory, _CURRENT)
    version = storage.path(current).read_text().strip()
    # CURRENT names a folder this class wrote, never a path elsewhere.
    if not _VERSION.fullmatch(version):
      raise ValueError(f"{current}: {version[:80]!r} is not a bank version "
                       "name")
    folder = storage.join(directory, version)
    meta_path = storage.join(folder, "meta.json")
    meta = json.loads(storage.path(meta_path).read_text())
    if meta.get("format_version") != FORMAT_VERSION:
      raise ValueError(f"{meta_path}: unsupported format_version "
                       f"{meta.get('format_version')!r}")
    bank = cls(meta["user_id"], meta["dim"])
    bank.core, bank.step, bank._next_id = (meta["core"], meta["step"],
                                           meta["next_id"])
    entries_path = storage.join(folder, "entries.jsonl")
    by_type: dict[MemoryType, list[MemoryEntry]] = {t: [] for t in ENTRY_TYPES}
    for line in storage.path(entries_path).read_text().splitlines():
      entry = _entry_from_json(json.loads(line))
      by_type[entry.memory_type].append(entry)
    for memory_type in ENTRY_TYPES:
      index_path = storage.join(folder, f"{memory_type.value}.faiss")
      index = faiss.deserialize_index(np.frombuffer(
          storage.path(index_path).read_bytes(), np.uint8))
      if index.ntotal != len(by_type[memory_type]) or index.d != bank.dim:
        raise ValueError(f"{index_path}: {index.ntotal} vectors of dim "
                         f"{index.d} for {len(by_type[memory_type])} "
                         f"{memory_type.value} entries of dim {bank.dim}")
      store = bank.stores[memory_type]
      store.entries = by_type[memory_type]
      store._vectors = (index.reconstruct_n(0, index.ntotal)
                        if index.ntotal else store.vectors)
    return bank


def _entry_to_json(entry: MemoryEntry) -> dict:
  row = dataclasses.asdict(entry)
  row["memory_type"] = entry.memory_type.value
  return row


def _entry_from_json(row: dict) -> MemoryEntry:
  row = dict(row)
  row["memory_type"] = MemoryType(row["memory_type"])
  row["turn_ids"] = tuple(row["turn_ids"])
  row["links"] = tuple(row["links"])
  return MemoryEntry(**row)


def _write_file(path: str, data: bytes) -> None:
  if storage.is_remote(path):  # One whole object.
    storage.write_atomic(path, data)
    return
  with open(path, "wb") as f:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
  if storage.is_remote(path):  # Object storage has no directories.
    return
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _remove_stale_temporaries(directory: str) -> None:
  """Deletes staging folders left by a writer that crashed mid-save."""
  for name in os.listdir(directory):
    if name.startswith(".tmp-") and _VERSION.fullmatch(name[len(".tmp-"):]):
      shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def embed_texts(encoder, texts: Sequence[str], kind: str = "document"
                ) -> np.ndarray:
  """Encodes texts and checks the encoder kept its contract."""
  if not texts:
    return np.zeros((0, encoder.dim), np.float32)
  vectors = np.asarray(encoder.encode(list(texts), kind=kind), np.float32)
  if vectors.shape != (len(texts), encoder.dim):
    raise ValueError(f"encoder returned shape {vectors.shape}, expected "
                     f"{(len(texts), encoder.dim)}")
  if not np.isfinite(vectors).all():
    raise ValueError("encoder returned NaN/inf embeddings")
  return vectors
