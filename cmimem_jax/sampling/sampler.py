"""KV-cache sampler for rollouts and inference (SPEC §2.4).

Prompts are left-padded to a bucketed length (few compiled shapes), run
through one prefill, then decoded in a `lax.while_loop` with a preallocated
KV cache that is donated to the jitted program. Each step samples with
temperature and top-p (greedy at temperature 0) and records the log-prob of
the sampled token under the full temperature-scaled distribution (what the
GRPO trainer recomputes). Rows stop at EOS or a stop sequence; lengths are
per row. With a `TokenConstraint` (grammar-constrained decoding) each step
masks the logits to the tokens the automaton allows within the remaining
token budget, on device; the recorded log-probs are under that mask.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from cmimem_jax.models.host_memory import release_free_heap
from cmimem_jax.models.qwen3.model import KVCache, Qwen3, positions_from_mask
from cmimem_jax.parallel.mesh import BATCH_AXES, batch_divisor
from cmimem_jax.parallel.partition import fit_spec
from cmimem_jax.sampling.constraint import TokenConstraint, constrain_logits

# Prompt lengths a compiled program is padded to: powers of two up to 1,024,
# then steps of a quarter octave, so a prompt just over a power of two pads
# by at most 25% (a 2,319-token prompt decodes 192 tokens in ~17 s at 2,560
# vs ~25 s at 4,096 with SmolLM2-135M on 2 CPU cores; each extra length
# costs one compile).
DEFAULT_BUCKETS = (64, 128, 256, 512) + tuple(
    octave * quarter // 4 for octave in (1024, 2048, 4096, 8192, 16384)
    for quarter in (4, 5, 6, 7)) + (32768,)


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  temperature: float = 0.8
  top_p: float = 0.9
  max_new_tokens: int = 256
  eos_ids: tuple[int, ...] = ()
  pad_id: int = 0

  def __post_init__(self):
    if self.temperature < 0 or not 0 < self.top_p <= 1:
      raise ValueError("temperature must be >= 0 and top_p in (0, 1]")
    if self.max_new_tokens < 1:
      raise ValueError("max_new_tokens must be positive")


@dataclasses.dataclass
class SampleOutput:
  """Generated tokens `[B, max_new]` (pad after the end), the log-prob of
  each sampled token `[B, max_new]` (0 after the end), per-row `lengths`
  (tokens generated, including the EOS), and the prompt layout used."""
  tokens: np.ndarray
  logprobs: np.ndarray
  lengths: np.ndarray
  prompt_tokens: np.ndarray
  prompt_mask: np.ndarray

  def completions(self) -> list[list[int]]:
    return [row[:n].tolist() for row, n in zip(self.tokens, self.lengths)]


def bucket_length(length: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> int:
  for bucket in buckets:
    if length <= bucket:
      return bucket
  raise ValueError(f"prompt of {length} tokens exceeds the largest bucket "
                   f"{buckets[-1]}")


def left_pad(prompts: Sequence[Sequence[int]], length: int, pad_id: int
             ) -> tuple[np.ndarray, np.ndarray]:
  tokens = np.full((len(prompts), length), pad_id, np.int32)
  mask = np.zeros((len(prompts), length), np.int32)
  for row, prompt in enumerate(prompts):
    if len(prompt) > length:
      raise ValueError(f"prompt {row} has {len(prompt)} tokens > {length}")
    if len(prompt):
      tokens[row, length - len(prompt):] = prompt
      mask[row, length - len(prompt):] = 1
  return tokens, mask


def nucleus_mask(probs: jax.Array, top_p: jax.Array) -> jax.Array:
  """Top-p keep mask of `[B, V]` probabilities for `[B]` thresholds: token i
  is kept iff the mass of the tokens strictly more probable than it is below
  `top_p` (the smallest prefix of the sorted vocabulary whose mass reaches
  top_p, with every token tied at its edge kept; at least one token).

  No sort: the smallest probability kept is found by bisection over the bit
  patterns of non-negative float32s, which order like the floats, so 31
  halvings land on it exactly. Each halving is one compare-and-sum over the
  vocabulary; an argsort of it (XLA:CPU, TPU) costs several times more.
  """
  bits = jax.lax.bitcast_convert_type(probs, jnp.int32)

  def mass_above(threshold: jax.Array) -> jax.Array:  # [B] -> [B]
    return jnp.sum(jnp.where(bits > threshold[:, None], probs, 0.0), axis=-1)

  def halve(_, bounds):
    # Invariant: mass_above(high) < top_p <= mass_above(low - 1), i.e. the
    # answer lies in [low, high].
    low, high = bounds
    middle = low + (high - low) // 2
    inside = mass_above(middle) < top_p
    return jnp.where(inside, low, middle + 1), jnp.where(inside, middle, high)

  low = jnp.zeros(probs.shape[:1], jnp.int32)
  _, smallest_kept = jax.lax.fori_loop(0, 31, halve,
                                       (low, jnp.max(bits, axis=-1)))
  return bits >= smallest_kept[:, None]


def sample_token(logits: jax.Array, key: jax.Array,
                 temperature: jax.Array | float, top_p: jax.Array | float
                 ) -> tuple[jax.Array, jax.Array]:
  """Samples from `[B, V]` float32 logits; returns (token `[B]`, log-prob
  `[B]`).

  `temperature` / `top_p` are scalars or `[B]` per row, and traced, so new
  values never recompile. Temperature 0 is greedy. The log-prob is under
  the full distribution at the row's temperature (1 when greedy), before
  top-p truncation: the quantity the trainer recomputes.
  """
  batch = logits.shape[0]
  temperature = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32),
                                 (batch,))
  top_p = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), (batch,))
  greedy = temperature == 0
  scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
  logprobs = jax.nn.log_softmax(scaled, axis=-1)
  truncate = ~greedy & (top_p < 1)

  def nucleus(scaled: jax.Array) -> jax.Array:
    keep = nucleus_mask(jnp.exp(logprobs), top_p) | ~truncate[:, None]
    return jnp.where(keep, scaled, -jnp.inf)

  # Truncation is the costliest part of a decode step: skip it when no row
  # truncates.
  masked = jax.lax.cond(jnp.any(truncate), nucleus, lambda x: x, scaled)
  token = jnp.where(greedy, jnp.argmax(logits, axis=-1),
                    jax.random.categorical(key, masked, axis=-1))
  return token, jnp.take_along_axis(logprobs, token[:, None], axis=-1)[:, 0]


# graph=False: the policy is passed as a pytree. NNX's default graph mode
# hands every parameter back out of the program, which copies all weights
# on each call (~1 s for a 0.6B model on CPU).
# Temperature, top-p and each row's token budget are traced `[B]` arrays:
# only shapes (batch, prompt bucket, the budget cap) and EOS / pad ids select
# a compiled program.
@functools.partial(nnx.jit, static_argnames=("max_new_tokens", "eos_ids",
                                             "pad_id", "unrolled",
                                             "split_rows"),
                   donate_argnames=("prompt_cache", "cache"), graph=False)
def _generate(model: Qwen3, tokens: jax.Array, mask: jax.Array,
              prompt_cache: KVCache, cache: KVCache, key: jax.Array,
              temperature: jax.Array, top_p: jax.Array, budget: jax.Array,
              stop_table: jax.Array,
              constraint: tuple[jax.Array, jax.Array, jax.Array] | None, *,
              max_new_tokens: int, eos_ids: tuple[int, ...], pad_id: int,
              unrolled: bool, split_rows: bool = False):
  """P distinct prompts `tokens` `[P, Tp]` prefilled once into
  `prompt_cache` `[L, Tp, KV, P, D]`; B = P·N rows (row b continues prompt
  b // N) decode into their own `cache` `[L, max_new_tokens, KV, B, D]`,
  attending to their prompt's shared keys first. `unrolled`: decode over
  per-layer weight and cache copies (`Qwen3Config.decode_loop`).
  `split_rows`: the per-row state stays split over the context mesh's
  batch axes (`parallel.BATCH_AXES`), as the caches and prompts are
  (`Sampler`'s `decode_devices="mesh"`)."""
  batch = cache.valid.shape[0]
  group = batch // tokens.shape[0]

  def rows_split(x: jax.Array) -> jax.Array:
    """`x` `[B, ...]` kept split over the batch axes (no-op unless
    `split_rows`): XLA's propagation would otherwise be free to replicate
    the loop's per-row state."""
    if not split_rows:
      return x
    return jax.lax.with_sharding_constraint(
        x, PartitionSpec(BATCH_AXES, *([None] * (x.ndim - 1))))

  positions = positions_from_mask(mask)
  # The buffers are reused across calls: forget what they held.
  prompt_cache = KVCache(prompt_cache.keys, prompt_cache.values,
                         jnp.zeros_like(prompt_cache.valid))
  cache = KVCache(cache.keys, cache.values, jnp.zeros_like(cache.valid))
  hidden, prompt_cache = model.hidden_states(tokens, positions, mask,
                                             cache=prompt_cache, cache_index=0)
  # Only the last prompt position's logits are needed (the LM head over the
  # whole prompt would dominate prefill for large vocabularies).
  last_logits = rows_split(jnp.repeat(model.logits(hidden[:, -1]), group,
                                     axis=0))
  layers, prefix = None, prompt_cache
  if unrolled:
    layers = model.layer_params()
    cache, prefix = cache.per_layer(), prompt_cache.per_layer()
  next_position = jnp.repeat(positions[:, -1] + 1, group)
  eos = jnp.asarray(eos_ids or (-1,), jnp.int32)

  next_position = rows_split(next_position)
  out_tokens = rows_split(jnp.full((batch, max_new_tokens), pad_id,
                                   jnp.int32))
  out_logprobs = rows_split(jnp.zeros((batch, max_new_tokens), jnp.float32))
  done = rows_split(jnp.zeros((batch,), bool))
  lengths = rows_split(jnp.zeros((batch,), jnp.int32))
  # The automaton state of each row (unused without a constraint).
  grammar = jnp.zeros((batch,), jnp.int32)
  if constraint is not None:
    grammar = grammar + constraint[2]
  grammar = rows_split(grammar)

  def cond(state):
    step, _, _, _, _, done, _, _, _, _ = state
    return (step < max_new_tokens) & ~jnp.all(done)

  def body(state):
    (step, last_logits, cache, out_tokens, out_logprobs, done, lengths,
     next_position, key, grammar) = state
    key, sub = jax.random.split(key)
    if constraint is not None:
      next_table, budget_table, _ = constraint
      last_logits = constrain_logits(
          last_logits, budget_table[grammar], budget - step,
          jnp.asarray(eos_ids[0] if eos_ids else 0))
    token, logprob = sample_token(last_logits, sub, temperature, top_p)
    token = jnp.where(done, pad_id, token).astype(jnp.int32)
    if constraint is not None:
      grammar = jnp.where(done, grammar, next_table[grammar, token])
    out_tokens = out_tokens.at[:, step].set(token)
    out_logprobs = out_logprobs.at[:, step].set(jnp.where(done, 0.0, logprob))
    lengths = lengths + (~done).astype(jnp.int32)
    finished = (jnp.isin(token, eos) | (step + 1 >= budget)
                | _ends_with_stop(out_tokens, step, stop_table))
    new_done = done | finished
    step_mask = (~done).astype(jnp.int32)[:, None]
    logits, cache = model(token[:, None], next_position[:, None], step_mask,
                          cache=cache, cache_index=step, layers=layers,
                          prefix=prefix)
    return (step + 1, rows_split(logits[:, 0]), cache, out_tokens,
            out_logprobs, new_done, lengths, next_position + 1, key, grammar)

  state = (jnp.int32(0), last_logits, cache, out_tokens, out_logprobs, done,
           lengths, next_position, key, grammar)
  _, _, cache, out_tokens, out_logprobs, _, lengths, _, _, _ = (
      jax.lax.while_loop(cond, body, state))
  if layers is not None:
    cache = cache.stacked()
  return out_tokens, out_logprobs, lengths, prompt_cache, cache


@functools.lru_cache(maxsize=None)
def _zero_cache(keys: NamedSharding | None, valid: NamedSharding | None):
  """The program allocating a shape's KV buffers (`KVCache.zeros(config,
  rows, length)`) straight into their shardings: a cache split over the
  chips is never whole on one of them. `Sampler.compile` builds it ahead
  (eagerly, each `jnp.zeros` would compile on first use)."""
  shardings = None if keys is None else KVCache(keys, keys, valid)
  return jax.jit(KVCache.zeros, static_argnums=(0, 1, 2),
                 out_shardings=shardings)


# `Sampler(decode_devices=...)`: one device decodes, or the mesh does with
# the rows split over its batch axes.
DECODE_DEVICES = ("one", "mesh")


def shared_prompt_group(prompts: Sequence[Sequence[int]]) -> int:
  """N when the prompts are groups of N consecutive identical prompts (a
  GRPO batch: N rollouts per session), else 1."""
  rows = [tuple(p) for p in prompts]
  group = 1
  while group < len(rows) and rows[group] == rows[0]:
    group += 1
  if len(rows) % group or any(rows[i] != rows[i - i % group]
                              for i in range(len(rows))):
    return 1
  return group


# In a stop table: padding that matches any token, and a slot that never
# matches (no token id, nor the -2 that pads the output on the left).
STOP_ANY, STOP_NEVER = -1, -3


def stop_table(sequences: Sequence[Sequence[int]], slots: int | None = None,
               width: int | None = None) -> np.ndarray:
  """`[S, L]` int32: the token sequences right-aligned, padded with
  `STOP_ANY`; with `slots` / `width` a fixed shape, unused slots never
  matching (sequences longer than `width` are left out)."""
  sequences = [list(s) for s in sequences if s and (
      width is None or len(s) <= width)]
  width = max((len(s) for s in sequences), default=0) if width is None \
      else width
  slots = len(sequences) if slots is None else slots
  table = np.full((slots, width), STOP_ANY, np.int32)
  table[len(sequences):, -1:] = STOP_NEVER
  for i, seq in enumerate(sequences[:slots]):
    table[i, width - len(seq):] = seq
  return table


def _ends_with_stop(tokens: jax.Array, step: jax.Array,
                    stop_table: jax.Array) -> jax.Array:
  """Whether each row's output ends with any stop sequence at `step`.

  `stop_table` `[S, L]` (every row's) or `[B, S, L]` (each row its own)
  holds stop token sequences right-aligned, padded with `STOP_ANY`.
  """
  if stop_table.shape[-2] == 0:
    return jnp.zeros(tokens.shape[0], bool)
  length = stop_table.shape[-1]
  # Left-pad with a value no stop token has, so early steps never match;
  # padded[:, step + 1 : step + 1 + length] == tokens[:, step - length + 1 :
  # step + 1].
  padded = jnp.pad(tokens, [(0, 0), (length, 0)], constant_values=-2)
  window = jax.lax.dynamic_slice_in_dim(padded, step + 1, length, axis=1)
  table = stop_table if stop_table.ndim == 3 else stop_table[None]
  match = (table == window[:, None]) | (table == STOP_ANY)
  return jnp.any(jnp.all(match, axis=-1), axis=-1)


def wave_rows(rows: int, group: int, shards: int, max_rows_per_wave: int
              ) -> int:
  """Rows a decoding wave of `rows` rows in groups of `group` takes:
  whole groups x `shards` (the batch shards decoding), at most
  `max_rows_per_wave` but at least one such unit; 0: all rows at once."""
  unit = group * shards
  if not max_rows_per_wave:
    return rows
  return max(unit, max_rows_per_wave // unit * unit)


class Sampler:
  """Batched generation with a Flax `Qwen3` policy.

  Where it decodes (`decode_devices`, with a `mesh`):

  * "one": on the mesh's first device, from one copy of the weights
    gathered there (`release_weights` frees it). The CPU default: CPU
    devices share one host memory, so decoding on all of them would only
    hold the KV cache and the layer copies once per device (6.6 GiB for
    SmolLM2-135M on fsdp:8 against 4 on one device).
  * "mesh": on every chip, prompts, tokens, log-probs, the per-row
    sampling parameters and both KV caches (`[L, S, KV, B, D]`, spec
    `P(None, None, "tensor", BATCH_AXES, None)`) split over the batch
    axes (`parallel.BATCH_AXES`, data x fsdp): each chip holds 1 / shards
    of every cache. A wave's distinct prompts are padded to a multiple of
    the shards (copies of the last, dropped from the output), and waves
    are whole groups x shards rows. The weights stay as the learner holds
    them (FSDP-sharded, its own arrays: no copy, nothing to release); XLA
    gathers each layer's weights inside the layer loop as a decoding step
    needs them (in the compute dtype: it moves the cast before the
    all-gather), and the tied LM head once a step. Chosen over a decode
    copy (the layer weights cast and replicated once per wave) by the AOT
    compile of Table 7's wave on a v5p-8 (`tools/plan.py`, BENCHMARKS.md
    "TPU plan of Table 7"): the copy costs 7.0 GiB more per chip (66.2
    against 59.1 GiB for 4 sessions per chip), room a v6e-8 (32 GiB)
    barely has. The price is interconnect traffic each decoding step:
    every chip receives the (chips - 1) / chips of the bf16 weights it
    does not hold (Qwen3-4B on 4 chips: ~6 GB a step), which the plan's
    roofline does not count; a decode copy is the lever if decoding on a
    reservation proves bound by it.

  Sampling is sharding-invariant: `jax_threefry_partitionable` (JAX's
  default) draws each row's random bits from its position, not from the
  device holding it, so a mesh decodes the tokens one device decodes
  (tests/sampling/test_sampler.py).
  """

  def __init__(self, model: Qwen3, config: SamplingConfig = SamplingConfig(),
               buckets: Sequence[int] = DEFAULT_BUCKETS,
               stop_sequences: Sequence[Sequence[int]] = (),
               mesh: Mesh | None = None,
               constraint: TokenConstraint | None = None,
               max_cached_shapes: int = 4, share_prompts: bool = True,
               max_rows_per_wave: int = 0, decode_devices: str = "one",
               row_stop_shape: tuple[int, int] | None = None):
    """`mesh`: where the model's (sharded) parameters live; prompts, keys
    and the KV cache are then placed on it too, as `decode_devices` says
    ("one" | "mesh", see the class). `model` may be abstract
    (`ShapeDtypeStruct` leaves with shardings: `lower` only, as
    `tools/plan.py` builds it). `constraint`: every completion is a match
    of its regex, then EOS (which must be the first of `config.eos_ids`).
    `max_cached_shapes`: KV buffers kept for reuse (least recently used
    dropped first). `share_prompts`: groups of identical consecutive
    prompts are prefilled once and share one prompt KV cache (False: a
    copy per row; same tokens and log-probs). `max_rows_per_wave`: decode
    at most this many rows at once (rounded down to whole groups, times
    the batch shards with "mesh"; 0 = all), bounding the KV cache in
    memory (`tools/plan.py` gives the rows per chip that fit); each wave
    samples with its own key. `row_stop_shape` (slots, tokens): every call
    takes each row's own stop sequences (`generate(row_stops=...)`) in a
    table of that shape (a server: OpenAI's `stop`, up to 4 per request);
    None: the `stop_sequences` of every row."""
    if max_rows_per_wave < 0:
      raise ValueError("max_rows_per_wave must be >= 0")
    if decode_devices not in DECODE_DEVICES:
      raise ValueError(f"decode_devices must be one of {DECODE_DEVICES}, "
                       f"got {decode_devices!r}")
    self.decode_devices = decode_devices
    # Where the weights are moved to (None: they stay where they are).
    self._local_sharding = None
    if mesh is not None and decode_devices == "one" and mesh.devices.size > 1:
      mesh = Mesh(mesh.devices.flat[:1].reshape((1,) * mesh.devices.ndim),
                  mesh.axis_names)
      self._local_sharding = NamedSharding(mesh, PartitionSpec())
    if decode_devices == "mesh" and not jax.config.jax_threefry_partitionable:
      raise ValueError("decode_devices='mesh' needs jax_threefry_partitionable"
                       " (JAX's default): without it a row's samples depend "
                       "on how the rows are split")
    self.mesh = mesh
    self.abstract = any(isinstance(x, jax.ShapeDtypeStruct)
                        for x in jax.tree.leaves(nnx.state(model)))
    self.split_rows = mesh is not None and decode_devices == "mesh"
    # Rows of a wave split this many ways (1: one device, or no mesh).
    self.row_shards = batch_divisor(mesh) if self.split_rows else 1
    self.model = self._local(model)
    platform = (jax.default_backend() if mesh is None
                else mesh.devices.flat[0].platform)
    # `Qwen3Config.decode_loop` for the devices that decode (a plan for a
    # TPU compiled on a CPU host scans, as the TPU does).
    loop = model.config.decode_loop
    self.unrolled = loop == "unrolled" or (loop == "auto"
                                           and platform == "cpu")
    self.share_prompts = share_prompts
    self.max_rows_per_wave = max_rows_per_wave
    self._sharding = (None if mesh is None
                      else NamedSharding(mesh, PartitionSpec()))
    # The splash attention kernel of a TPU prefill shards over the mesh in
    # context (`models.attention`); the decode loop's row constraints name
    # its axes.
    self._mesh_context = ((lambda: contextlib.nullcontext()) if mesh is None
                          else lambda: jax.set_mesh(mesh))
    self.config = config
    self.buckets = tuple(buckets)
    self.stop_table = self._place(stop_table(stop_sequences))
    # (slots, tokens) of the per-row stop tables (`row_stops`): one shape
    # for every call, so a server's warm-up compiles what requests run.
    self.row_stop_shape = row_stop_shape
    self.constraint = constraint
    self._constraint_arrays = None
    if constraint is not None:
      if constraint.eos_id not in config.eos_ids[:1]:
        raise ValueError(f"the constraint ends with token {constraint.eos_id};"
                         f" the sampler's first EOS id is {config.eos_ids}")
      # The learner of the same constraint reads the same device tables.
      tables = (tuple(self._place(constraint.padded_table(
          name, model.config.vocab_size)) for name in ("next_state",
                                                        "min_budget"))
                if self.abstract else constraint.device_tables(
                    model.config.vocab_size, self._sharding))
      self._constraint_arrays = (
          *tables, self._place(np.asarray(np.int32(constraint.initial_state))))
    # The (prompt, rows') KV buffers of the most recently used shapes (LRU,
    # bounded: a server sees many batch / length combinations).
    self._caches: collections.OrderedDict[
        tuple[int, ...], tuple[KVCache, KVCache]] = collections.OrderedDict()
    self.max_cached_shapes = max_cached_shapes
    self._compiled_shapes: set[tuple[int, ...]] = set()

  def _place(self, x: Any, sharding: NamedSharding | None = None) -> Any:
    """`x` (an array, or a `ShapeDtypeStruct`) on the sampler's devices
    (`sharding`, default replicated). An abstract sampler (abstract
    weights: compiled for devices this process may not have, e.g. a TPU
    topology's) places nothing: it describes `x` with the sharding."""
    sharding = sharding or self._sharding
    if self.abstract or isinstance(x, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    return x if sharding is None else jax.device_put(jnp.asarray(x),
                                                     sharding)

  def _rows_sharding(self, ndim: int) -> NamedSharding | None:
    """A `[B, ...]` array's sharding: split over the batch axes with
    "mesh", else replicated (None without a mesh)."""
    if not self.split_rows:
      return self._sharding
    return NamedSharding(self.mesh,
                         PartitionSpec(BATCH_AXES, *([None] * (ndim - 1))))

  def _cache_shardings(self, rows: int, length: int
                       ) -> tuple[NamedSharding | None, NamedSharding | None]:
    """(keys / values, valid) shardings of a `rows` x `length` KV cache:
    `[L, S, KV, B, D]` split over the batch axes on B (and `tensor` on
    KV where it divides) with "mesh"."""
    if not self.split_rows:
      return self._sharding, self._sharding
    c = self.model.config
    shape = (c.num_hidden_layers, length, c.num_key_value_heads, rows,
             c.head_dim)
    spec = fit_spec(PartitionSpec(None, None, "tensor", BATCH_AXES, None),
                    shape, self.mesh)
    return NamedSharding(self.mesh, spec), self._rows_sharding(2)

  def _zeros(self, rows: int, length: int) -> KVCache:
    return _zero_cache(*self._cache_shardings(rows, length))(
        self.model.config, rows, length)

  def set_model(self, model: Qwen3) -> None:
    """Samples from `model` from now on (same graph: no recompilation)."""
    self.model = self._local(model)

  def _local(self, model: Qwen3) -> Qwen3:
    """`model` with its weights on the sampler's one device when it
    decodes on one device of a mesh (see the class; abstract weights get
    that sharding), else itself."""
    state = nnx.state(model)
    if self._local_sharding is None or all(
        x.sharding.is_equivalent_to(self._local_sharding, x.ndim)
        for x in jax.tree.leaves(state)):
      return model
    local = self._local_sharding
    return nnx.merge(nnx.graphdef(model), jax.tree.map(
        lambda x: (jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=local)
                   if isinstance(x, jax.ShapeDtypeStruct)
                   else jax.device_put(x, local)), state))

  def release_weights(self) -> None:
    """Drops the sampler's own copy of the weights, if it has one (the
    one-device copy of "one" on a mesh, see the class; 0.5 GiB for
    SmolLM2-135M): a trainer calls it before its update, which replaces
    the weights, and hands the new ones over with `set_model` before the
    next call."""
    if self._local_sharding is not None:
      self.model = None

  def release_caches(self) -> None:
    """Frees the KV buffers kept for reuse (the next call of each shape
    allocates them again): a trainer calls it before its update, which
    needs the memory more (one 8-row SmolLM2-135M cache of a 768-token
    bucket is 0.3 GiB)."""
    self._caches.clear()

  def release_programs(self) -> None:
    """Drops every compiled decoding program of this process (a later call
    of a shape compiles it again, or loads it from JAX's persistent
    compilation cache): a trainer calls it before its first step, whose
    shape the start-up's calls (one prompt at a time: the initial policy's
    demo, memory snapshots) never have, and with
    `rollout.release_programs_each_step` before every update. On CPU each
    program decodes over per-layer weights, unrolled: ~0.1 GiB of machine
    code for SmolLM2-135M.
    """
    self.release_caches()
    _generate.jitted_fn.clear_cache()
    self._compiled_shapes.clear()
    release_free_heap()

  # -- `GenerationEngine` hooks of a training step ---------------------------

  # The log-probs it reports are the learner's own (the same model and
  # math): the step takes them as the old log-probs.
  reports_learner_logprobs = True

  def release(self, programs: bool = False, weights: bool = False) -> None:
    """`GenerationEngine.release`: frees the KV buffers kept for reuse;
    with `programs` the compiled programs too (`release_programs`), with
    `weights` the sampler's own weight copy (`release_weights`)."""
    if programs:
      self.release_programs()
    else:
      self.release_caches()
    if weights:
      self.release_weights()

  def update_metrics(self) -> dict[str, Any]:
    """`GenerationEngine.update_metrics`: nothing to report."""
    return {}

  # --------------------------------------------------------------------------

  def generate(self, prompts: Sequence[Sequence[int]], key: jax.Array,
               temperature: float | Sequence[float],
               top_p: float | Sequence[float], max_new_tokens: int,
               row_budgets: Sequence[int] | None = None,
               constrained: bool = True,
               row_stops: Sequence[Sequence[Sequence[int]]] | None = None
               ) -> SampleOutput:
    """`GenerationEngine.generate`: this sampler's EOS / pad ids with the
    given sampling parameters, one value for every row or one per row.
    `row_budgets`: each row stops after its own number of tokens (at most
    `max_new_tokens`, which alone shapes the compiled program).
    `constrained=False`: ignore the sampler's `TokenConstraint`.
    `row_stops`: each row's stop token sequences (a sampler made with
    `row_stop_shape`; sequences longer than its tokens are left out)."""
    return self._sample(prompts, key, temperature, top_p, dataclasses.replace(
        self.config, max_new_tokens=max_new_tokens), row_budgets,
                        constrained, row_stops)

  def __call__(self, prompts: Sequence[Sequence[int]], key: jax.Array,
               config: SamplingConfig | None = None) -> SampleOutput:
    """Generates for token-id prompts (any lengths; left-padded here)."""
    config = config or self.config
    return self._sample(prompts, key, config.temperature, config.top_p, config)

  def wave_rows(self, rows: int, group: int) -> int:
    """Rows one decoding wave of `rows` rows in groups of `group` takes
    (`wave_rows` with this sampler's shards and wave limit)."""
    return wave_rows(rows, group, self.row_shards, self.max_rows_per_wave)

  def generate_waves(self, prompts: Sequence[Sequence[int]], key: jax.Array,
                     temperature: float | Sequence[float],
                     top_p: float | Sequence[float], max_new_tokens: int,
                     row_budgets: Sequence[int] | None = None,
                     constrained: bool = True,
                     row_stops: Sequence[Sequence[Sequence[int]]] | None = None,
                     ahead: bool = True) -> Iterator[SampleOutput]:
    """`GenerationEngine.generate_waves`: `generate`'s output one decoding
    wave at a time, in row order (the same waves and keys: concatenated,
    the waves are `generate`'s output). With `ahead`, wave w + 1's program
    is dispatched (JAX dispatches asynchronously) before wave w's outputs
    are fetched, so the devices decode it while the caller works on wave
    w; without, wave w + 1 is dispatched when the caller asks for it, so
    what the caller runs on the devices between waves never queues behind
    a wave. Arguments are checked before the first wave is asked for."""
    return self._waves(prompts, key, temperature, top_p, dataclasses.replace(
        self.config, max_new_tokens=max_new_tokens), row_budgets, constrained,
                       row_stops, ahead)

  def _sample(self, prompts: Sequence[Sequence[int]], key: jax.Array,
              temperature: float | Sequence[float],
              top_p: float | Sequence[float], config: SamplingConfig,
              row_budgets: Sequence[int] | None = None,
              constrained: bool = True,
              row_stops: Sequence[Sequence[Sequence[int]]] | None = None
              ) -> SampleOutput:
    outs = list(self._waves(prompts, key, temperature, top_p, config,
                            row_budgets, constrained, row_stops, ahead=True))
    if len(outs) == 1:
      return outs[0]
    return concatenate_outputs(outs)

  def _waves(self, prompts: Sequence[Sequence[int]], key: jax.Array,
             temperature: float | Sequence[float],
             top_p: float | Sequence[float], config: SamplingConfig,
             row_budgets: Sequence[int] | None, constrained: bool,
             row_stops: Sequence[Sequence[Sequence[int]]] | None,
             ahead: bool) -> Iterator[SampleOutput]:
    """Checks the arguments, then returns the iterator over the waves
    (`generate_waves`)."""
    if self.model is None:
      raise RuntimeError("the sampler's weights were released "
                         "(release_weights): set_model first")
    rows = len(prompts)
    temperature, top_p = (np.broadcast_to(np.asarray(v, np.float32), (rows,))
                          for v in (temperature, top_p))
    budgets = np.broadcast_to(np.asarray(
        config.max_new_tokens if row_budgets is None else row_budgets,
        np.int32), (rows,))
    if (temperature < 0).any() or not ((top_p > 0) & (top_p <= 1)).all():
      raise ValueError("temperature must be >= 0 and top_p in (0, 1]")
    if not ((budgets >= 1) & (budgets <= config.max_new_tokens)).all():
      raise ValueError(f"row budgets must be in [1, {config.max_new_tokens}]")
    constraint = self._constraint_arrays if constrained else None
    if constraint is not None and budgets.min() < self.constraint.shortest:
      raise ValueError(f"a token budget of {budgets.min()} is shorter "
                       f"than the constraint's shortest completion "
                       f"({self.constraint.shortest} tokens)")
    length = bucket_length(max(len(p) for p in prompts), self.buckets)
    if length + config.max_new_tokens > (
        self.model.config.max_position_embeddings):
      raise ValueError(f"prompt bucket {length} + {config.max_new_tokens} new "
                       f"tokens exceeds max_position_embeddings "
                       f"{self.model.config.max_position_embeddings}")
    # Identical consecutive prompts (the N rollouts of a session) are
    # prefilled once and their KV cache shared by the N rows.
    group = shared_prompt_group(prompts) if self.share_prompts else 1
    # Waves of whole groups bound the KV cache held at once.
    wave = self.wave_rows(rows, group)
    keys = [key] if wave >= rows else jax.random.split(key, -(-rows // wave))
    stops = self._row_stop_tables(rows, row_stops)

    def dispatch(index: int) -> _PendingWave:
      start = index * wave
      part = slice(start, start + wave)
      return self._dispatch_wave(
          prompts[part], keys[index], temperature[part], top_p[part],
          budgets[part], config, length, group, constraint,
          None if stops is None else stops[part])

    def waves() -> Iterator[SampleOutput]:
      count = len(keys)
      pending = dispatch(0)
      for index in range(count):
        following = (dispatch(index + 1)
                     if ahead and index + 1 < count else None)
        yield pending.fetch()
        if not ahead and index + 1 < count:
          following = dispatch(index + 1)
        pending = following

    return waves()

  def _row_stop_tables(self, rows: int,
                       row_stops: Sequence[Sequence[Sequence[int]]] | None
                       ) -> np.ndarray | None:
    """`[rows, slots, tokens]` per-row stop tables (`row_stop_shape`), or
    None: every row's `stop_sequences`."""
    if self.row_stop_shape is None:
      if row_stops is not None:
        raise ValueError("per-row stop sequences need a sampler made with "
                         "row_stop_shape")
      return None
    row_stops = row_stops if row_stops is not None else [()] * rows
    if len(row_stops) != rows:
      raise ValueError(f"{len(row_stops)} rows of stop sequences for {rows} "
                       "prompts")
    return np.stack([stop_table(s, *self.row_stop_shape) for s in row_stops])

  def padded_prompts(self, prompts: int) -> int:
    """Distinct prompts a wave of `prompts` is decoded as: a multiple of
    the batch shards (the rest copies of the last prompt, dropped from the
    output)."""
    return -(-prompts // self.row_shards) * self.row_shards

  def lower(self, rows: int, length: int, max_new_tokens: int,
            group: int = 1, constrained: bool = True) -> jax.stages.Lowered:
    """The program `generate` runs for one wave of `rows` rows in groups of
    `group` identical prompts (`rows / group` prefilled prompts, padded
    as a wave is: `padded_prompts`) in prompt bucket `length` with
    `max_new_tokens`, lowered from abstract shapes (placed as `generate`
    places them): nothing runs and no KV cache is allocated. What
    `tools/plan.py` compiles, from abstract weights."""
    if rows % group:
      raise ValueError(f"{rows} rows are not whole groups of {group}")
    config = dataclasses.replace(self.config, max_new_tokens=max_new_tokens)
    prompts = self.padded_prompts(rows // group)
    rows = prompts * group
    tokens = jax.ShapeDtypeStruct((prompts, length), np.int32)
    per_row = jax.ShapeDtypeStruct((rows,), np.float32)
    budgets = jax.ShapeDtypeStruct((rows,), np.int32)
    caches = tuple(self._abstract_cache(*s)
                   for s in ((prompts, length), (rows, max_new_tokens)))
    # The key as `generate` gets it: split from another key.
    key = jax.eval_shape(lambda: jax.random.split(jax.random.key(0))[0])
    constraint = self._constraint_arrays if constrained else None
    with self._mesh_context():
      return _generate.lower(*self._arguments(
          tokens, tokens, caches, key, per_row, per_row, budgets,
          constraint, self._row_stop_tables(rows, None)),
                             **self._static_arguments(config))

  def _abstract_cache(self, rows: int, length: int) -> KVCache:
    keys, valid = self._cache_shardings(rows, length)
    shapes = jax.eval_shape(functools.partial(
        KVCache.zeros, self.model.config, rows, length))
    return KVCache(*(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
                     for x, s in ((shapes.keys, keys), (shapes.values, keys),
                                  (shapes.valid, valid))))

  def compile(self, rows: int, length: int, max_new_tokens: int,
              constrained: bool = True, group: int = 1) -> None:
    """Compiles, or loads from JAX's persistent compilation cache, the
    program `generate` runs for `rows` rows (`lower`), and its KV buffers'
    allocation: a later `generate` of that shape runs it without
    compiling."""
    prompts = self.padded_prompts(rows // group)
    for s in ((prompts, length), (prompts * group, max_new_tokens)):
      _zero_cache(*self._cache_shardings(*s)).lower(
          self.model.config, *s).compile()
    self.lower(rows, length, max_new_tokens, group, constrained).compile()

  def _arguments(self, tokens: np.ndarray, mask: np.ndarray,
                 caches: tuple[KVCache, KVCache], key: jax.Array,
                 temperature: np.ndarray, top_p: np.ndarray,
                 budgets: np.ndarray,
                 constraint: tuple[jax.Array, ...] | None,
                 row_stops: np.ndarray | None = None) -> tuple:
    """`_generate`'s positional arguments, placed as `_wave` runs them
    (`lower` places the same, abstract, so both select one program)."""
    def place(x: np.ndarray | jax.ShapeDtypeStruct) -> Any:
      return self._place(x, self._rows_sharding(x.ndim))
    return (self.model, place(tokens), place(mask), *caches, self._place(key),
            place(temperature), place(top_p), place(budgets),
            self.stop_table if row_stops is None else place(row_stops),
            constraint)

  def _static_arguments(self, config: SamplingConfig) -> dict:
    return {"max_new_tokens": config.max_new_tokens,
            "eos_ids": tuple(config.eos_ids), "pad_id": config.pad_id,
            "unrolled": self.unrolled, "split_rows": self.split_rows}

  def _dispatch_wave(self, prompts: Sequence[Sequence[int]],
                     key: jax.Array, temperature: np.ndarray,
                     top_p: np.ndarray, budgets: np.ndarray,
                     config: SamplingConfig, length: int, group: int,
                     constraint: tuple[jax.Array, ...] | None,
                     row_stops: np.ndarray | None = None) -> _PendingWave:
    """Dispatches one compiled generation over `prompts` (groups of `group`
    identical prompts), left-padded to `length`, under `constraint`'s
    tables (None: free), without waiting for it. With "mesh" the distinct
    prompts are padded to a multiple of the batch shards
    (`padded_prompts`)."""
    rows = len(prompts)
    distinct = list(prompts[::group])
    extra = self.padded_prompts(len(distinct)) - len(distinct)
    if extra:
      distinct += [distinct[-1]] * extra
      temperature, top_p, budgets = (
          np.concatenate([x, np.repeat(x[-1:], extra * group, axis=0)])
          for x in (temperature, top_p, budgets))
      if row_stops is not None:
        row_stops = np.concatenate(
            [row_stops, np.repeat(row_stops[-1:], extra * group, axis=0)])
    tokens, mask = left_pad(distinct, length, config.pad_id)
    shape = (len(tokens), length, len(tokens) * group, config.max_new_tokens)
    # One preallocated pair of caches per shape, donated to the program and
    # handed back, so decoding updates them in place and calls never
    # reallocate them (a wave dispatched behind another of its shape takes
    # that wave's caches as they will be: the same buffers, in order).
    caches = self._caches.pop(shape, None) or tuple(
        self._zeros(*s) for s in (shape[:2], shape[2:]))
    with self._mesh_context():
      out_tokens, out_logprobs, lengths, *caches = _generate(
          *self._arguments(tokens, mask, caches, key, temperature, top_p,
                           budgets, constraint, row_stops),
          **self._static_arguments(config))
    if shape not in self._compiled_shapes:
      # The first call of a shape compiled it: XLA / LLVM's freed small
      # allocations (hundreds of MB) would otherwise stay resident.
      self._compiled_shapes.add(shape)
      release_free_heap()
    self._caches[shape] = tuple(caches)
    while len(self._caches) > self.max_cached_shapes:
      self._caches.popitem(last=False)
    return _PendingWave(out_tokens, out_logprobs, lengths,
                        np.repeat(tokens, group, axis=0)[:rows],
                        np.repeat(mask, group, axis=0)[:rows], rows)


@dataclasses.dataclass
class _PendingWave:
  """A dispatched wave: its device outputs (still computing) and prompt
  layout; `fetch` waits for them."""
  tokens: jax.Array
  logprobs: jax.Array
  lengths: jax.Array
  prompt_tokens: np.ndarray
  prompt_mask: np.ndarray
  rows: int

  def fetch(self) -> SampleOutput:
    """The wave's `SampleOutput` on the host (blocks until decoded)."""
    return SampleOutput(np.asarray(self.tokens)[:self.rows],
                        np.asarray(self.logprobs)[:self.rows],
                        np.asarray(self.lengths)[:self.rows],
                        self.prompt_tokens, self.prompt_mask)


def concatenate_outputs(outputs: Sequence[SampleOutput]) -> SampleOutput:
  """Consecutive waves' outputs as one (rows in order; every wave the same
  prompt bucket and width)."""
  return SampleOutput(*(np.concatenate([getattr(o, f.name) for o in outputs])
                        for f in dataclasses.fields(SampleOutput)))
