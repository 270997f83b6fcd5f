"""Grammar-constrained decoding as device arrays (SPEC §3.3).

`outlines-core` compiles a regex against the tokenizer's vocabulary into a
token-level automaton; here it becomes two dense tables that the jitted
decode loop and the learner index without any host round trip:

- `next_state [S, V]` int16 (int32 past 32,767 states): the state after
  emitting token v in state s, -1 where v is not allowed;
- `min_budget [S, V] int16`: the fewest tokens (v itself included) that
  finish a match after emitting v in state s — `_NEVER` where v is not
  allowed.

A token is allowed at a step with `budget` tokens left (the current one
included) iff `min_budget[state, token] <= budget`: the automaton bounds
the *form* and the budget bounds the *length*, so every row ends in a
complete match (then EOS) within `max_new_tokens` whenever the initial
state can finish at all. The sampler records log-probs under exactly this
mask, and the learner (`rl.token_logprobs(..., constraint=...)`) applies
the same mask from the per-token states and budgets, so the GRPO ratio
compares like with like.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import importlib.metadata
import io
import json
import os
import zipfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cmimem_jax.caches import cache_dir
from cmimem_jax.data.files import write_atomic
from cmimem_jax.models.host_memory import release_free_heap

_NEVER = np.iinfo(np.int16).max


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
  """GPT-2 byte-level BPE: the printable character standing for each byte
  (the inverse of the map byte-level tokenizers write their vocab in)."""
  printable = (list(range(ord("!"), ord("~") + 1))
               + list(range(ord("¡"), ord("¬") + 1))
               + list(range(ord("®"), ord("ÿ") + 1)))
  chars, extra = list(printable), 0
  for byte in range(256):
    if byte not in printable:
      printable.append(byte)
      chars.append(256 + extra)
      extra += 1
  return {chr(c): b for b, c in zip(printable, chars)}


def token_bytes(tokenizer: Any) -> dict[bytes, list[int]]:
  """`{bytes: [token ids]}` of a byte-level BPE tokenizer's non-special
  tokens (what `outlines_core.Vocabulary` takes).

  Raises:
    ValueError: for a tokenizer whose vocabulary is not byte-level (a
      SentencePiece vocabulary needs its own conversion).
  """
  decoder = _byte_decoder()
  special = set(tokenizer.all_special_ids)
  out: dict[bytes, list[int]] = collections.defaultdict(list)
  for token, token_id in tokenizer.get_vocab().items():
    if token_id in special:
      continue
    try:
      out[bytes(decoder[c] for c in token)].append(token_id)
    except KeyError as e:
      raise ValueError(f"token {token!r} is not byte-level BPE; constrained "
                       "decoding supports byte-level vocabularies") from e
  return dict(out)


@dataclasses.dataclass(frozen=True, eq=False)
class TokenConstraint:
  """A regex as a token automaton with length budgets (see module doc).

  Attributes:
    next_state: `[S, V]` int16 host table (int32 past 32,767 states;
      -1: not allowed).
    min_budget: `[S, V]` int16 host table (`_NEVER`: not allowed).
    initial_state: the state before the first token.
    eos_id: the token that ends a complete match.
  """
  next_state: np.ndarray
  min_budget: np.ndarray
  initial_state: int
  eos_id: int
  # `device_table` by (table, vocabulary, sharding): one copy of each
  # table for the sampler and the learner (40 MB each for the DSL over
  # SmolLM2's vocabulary), not one per user, and only the tables a user
  # reads (the learner reads no `next_state`).
  _placed: dict[Any, jax.Array] = dataclasses.field(
      default_factory=dict, init=False, repr=False)

  @classmethod
  def from_regex(cls, regex: str, tokenizer: Any) -> TokenConstraint:
    """`regex` over `tokenizer`'s vocabulary: compiled once (outlines-core,
    ~10 s for the DSL over SmolLM2's 49k tokens) and kept under
    `cache_dir()/constraints`, keyed by the regex, the vocabulary and the
    outlines-core version; later calls, in any process, load the tables in
    well under a second. An unwritable or damaged cache is logged and
    bypassed, never fatal."""
    path = os.path.join(cache_dir(), "constraints",
                        f"{_cache_key(regex, tokenizer)}.npz")
    cached = _load_tables(cls, path)
    if cached is not None:
      return cached
    constraint = cls._compile(regex, tokenizer)
    _save_tables(constraint, path)
    return constraint

  @classmethod
  def _compile(cls, regex: str, tokenizer: Any) -> TokenConstraint:
    """The automaton of `regex` (outlines-core) as dense tables."""
    from outlines_core import Index, Vocabulary
    eos = int(tokenizer.eos_token_id)
    index = Index(regex, Vocabulary(eos, token_bytes(tokenizer)))
    transitions = index.get_transitions()
    states = sorted(transitions)
    row = {s: i for i, s in enumerate(states)}
    vocab = max(len(tokenizer), max(tokenizer.get_vocab().values()) + 1)
    next_state = np.full((len(states), vocab), -1, np.int32)
    final = {row[s] for s in index.get_final_states()}
    for state, moves in transitions.items():
      for token, target in moves.items():
        # EOS is only a way out of a final state, never a transition.
        if token != eos:
          next_state[row[state], token] = row[target]
    for state in final:
      next_state[state, eos] = state
    # int16 where the states fit: half the bytes of a vocabulary-wide
    # table on the host and on every device.
    small = len(states) <= np.iinfo(np.int16).max
    constraint = cls(next_state.astype(np.int16) if small else next_state,
                     _min_budgets(next_state, final, eos),
                     row[index.get_initial_state()], eos)
    # The index and the vocabulary's byte strings (~0.5 GB for a 49k-token
    # vocabulary) are freed; glibc would keep their pages.
    del index, transitions
    release_free_heap()
    return constraint

  @property
  def shortest(self) -> int:
    """Tokens in the shortest complete completion (EOS included)."""
    return int(self.min_budget[self.initial_state].min())

  def padded_table(self, name: str, vocab_size: int) -> np.ndarray:
    """Table `name` ("next_state" or "min_budget") widened to a model's
    vocabulary (extra ids never allowed).

    Raises:
      ValueError: if the model's vocabulary is smaller than the tokenizer's.
    """
    fill = {"next_state": -1, "min_budget": _NEVER}[name]
    table = getattr(self, name)
    extra = vocab_size - table.shape[1]
    if extra < 0:
      raise ValueError(f"model vocabulary {vocab_size} < tokenizer "
                       f"vocabulary {table.shape[1]}")
    return np.pad(table, [(0, 0), (0, extra)], constant_values=fill)

  def device_table(self, name: str, vocab_size: int, sharding: Any = None
                   ) -> jax.Array:
    """`padded_table(name, vocab_size)` as a device array placed with
    `sharding` (None: the default device), placed once per (table,
    vocabulary, sharding) and shared by every caller."""
    key = (name, vocab_size, sharding)
    if key not in self._placed:
      self._placed[key] = jax.device_put(self.padded_table(name, vocab_size),
                                         sharding)
    return self._placed[key]

  def device_tables(self, vocab_size: int, sharding: Any = None
                    ) -> tuple[jax.Array, jax.Array]:
    """Both tables (`device_table`): `(next_state, min_budget)`."""
    return (self.device_table("next_state", vocab_size, sharding),
            self.device_table("min_budget", vocab_size, sharding))

  def states(self, tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """`[B, R]` state before each generated token (-1 past a row's end).

    Raises:
      ValueError: if a row holds a token the automaton does not allow
        (the rollout did not come from this constraint).
    """
    out = np.full(tokens.shape, -1, np.int32)
    for row in range(tokens.shape[0]):
      state = self.initial_state
      for col in range(int(lengths[row])):
        out[row, col] = state
        state = int(self.next_state[state, tokens[row, col]])
        if state < 0:
          raise ValueError(f"row {row} token {col} "
                           f"({int(tokens[row, col])}) is outside the "
                           "constraint")
    return out


# Bumped whenever the tables' layout or meaning changes.
_CACHE_FORMAT = 1


def _cache_key(regex: str, tokenizer: Any) -> str:
  """What the tables depend on: the regex, every (token, id) pair, the
  special ids (left out of the automaton), EOS, the table width and the
  outlines-core version."""
  digest = hashlib.sha256()
  digest.update(json.dumps(
      [_CACHE_FORMAT, importlib.metadata.version("outlines-core"), regex,
       int(tokenizer.eos_token_id), sorted(tokenizer.all_special_ids),
       len(tokenizer)]).encode())
  digest.update(json.dumps(sorted(tokenizer.get_vocab().items()),
                           ensure_ascii=False).encode())
  return digest.hexdigest()[:24]


def _load_tables(cls: type[TokenConstraint], path: str
                 ) -> TokenConstraint | None:
  """The constraint saved at `path`, or None (absent or unreadable)."""
  if not os.path.exists(path):
    return None
  try:
    with np.load(path) as saved:
      return cls(saved["next_state"], saved["min_budget"],
                 int(saved["initial_state"]), int(saved["eos_id"]))
  except (OSError, ValueError, KeyError, zipfile.BadZipFile) as error:
    from absl import logging
    logging.warning("constraint cache %s unreadable (%s); compiling the "
                    "regex again", path, error)
    return None


def _save_tables(constraint: TokenConstraint, path: str) -> None:
  """Writes the tables to `path` atomically (a reader sees all or none)."""
  buffer = io.BytesIO()
  np.savez(buffer, next_state=constraint.next_state,
           min_budget=constraint.min_budget,
           initial_state=constraint.initial_state, eos_id=constraint.eos_id)
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_atomic(path, buffer.getvalue())
  except OSError as error:  # A read-only cache directory.
    from absl import logging
    logging.warning("constraint not cached in %s: %s", path, error)


def _min_budgets(next_state: np.ndarray, final: set[int], eos: int
                 ) -> np.ndarray:
  """`min_budget[s, v]` = 1 + fewest tokens from `next_state[s, v]` to a
  finished match, where finishing from a final state costs one (EOS)."""
  num_states = next_state.shape[0]
  allowed = next_state >= 0
  allowed[:, eos] = False
  # Breadth-first from the final states over the reversed state graph
  # (hundreds of states; the token dimension only matters per edge set).
  predecessors: dict[int, set[int]] = collections.defaultdict(set)
  for state in range(num_states):
    for target in np.unique(next_state[state, allowed[state]]):
      predecessors[int(target)].add(state)
  finish = np.full(num_states, _NEVER, np.int64)
  frontier = sorted(final)
  finish[frontier] = 1
  while frontier:
    reached = []
    for target in frontier:
      for state in predecessors[target]:
        if finish[state] == _NEVER:
          finish[state] = finish[target] + 1
          reached.append(state)
    frontier = reached
  targets = np.where(allowed, next_state, 0)
  budget = np.where(allowed, finish[targets] + 1, _NEVER)
  budget[:, eos] = np.where(next_state[:, eos] >= 0, 1, _NEVER)
  return np.minimum(budget, _NEVER).astype(np.int16)


def constrain_logits(logits: jax.Array, min_budget_rows: jax.Array,
                     budget: jax.Array, eos_id: jax.Array) -> jax.Array:
  """Sets disallowed tokens' logits to -inf.

  Args:
    logits: `[..., V]` float32.
    min_budget_rows: `[..., V]` the `min_budget` rows of the current states.
    budget: `[...]` tokens left, the current one included.
    eos_id: where a row with no allowed token may go (only when the budget
      cannot finish the match: the row then ends, and fails to parse).

  Returns:
    `[..., V]` float32 logits.
  """
  allowed = min_budget_rows <= budget[..., None].astype(min_budget_rows.dtype)
  stuck = ~jnp.any(allowed, axis=-1, keepdims=True)
  allowed = allowed | (stuck & (jnp.arange(logits.shape[-1]) == eos_id))
  return jnp.where(allowed, logits, -jnp.inf)
