import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cmimem_jax.models.qwen3 import Qwen3, positions_from_mask, preset
from cmimem_jax.sampling import Sampler, SamplingConfig, left_pad
from cmimem_jax.sampling.sampler import (_generate, nucleus_mask,
                                         sample_token, shared_prompt_group)

PROMPTS = [[5, 17, 33, 2, 9], [44, 8], [3, 3, 3, 3, 3, 3, 3]]


@pytest.fixture(scope="module")
def model():
  return Qwen3(preset("tiny", vocab_size=64, max_position_embeddings=256),
               rngs=nnx.Rngs(0))


def _full_logits(model, rows):
  """Logits of the whole left-padded sequences, recomputed without cache."""
  length = max(len(r) for r in rows)
  tokens, mask = left_pad(rows, length, 0)
  logits, _ = model(jnp.asarray(tokens), positions_from_mask(mask),
                    jnp.asarray(mask))
  return np.asarray(logits), length


def test_nucleus_keeps_what_the_sorted_definition_keeps_ties_included():
  """Token i is kept iff the tokens strictly more probable than it hold less
  than top_p of the mass: checked against that definition in numpy, with a
  three-way tie at the edge (all three kept or none), a top_p below the
  largest probability (only the argmax) and a top_p of 1 (everything with
  non-zero mass)."""
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(5, 40)).astype(np.float32) * 3
  logits[0, :3] = logits[0].max() + 1.0  # Three tied most-probable tokens.
  top_p = np.array([0.5, 0.9, 0.99, 1e-6, 1.0], np.float32)
  probs = np.asarray(jax.nn.softmax(jnp.asarray(logits), axis=-1))
  expected = np.array([[probs[b][probs[b] > probs[b, i]].sum() < top_p[b]
                        for i in range(40)] for b in range(5)])
  kept = np.asarray(nucleus_mask(jnp.asarray(probs), jnp.asarray(top_p)))
  np.testing.assert_array_equal(kept, expected)
  assert kept[0, :3].all() and kept[3].sum() == 1 and kept[4].all()
  tokens, _ = jax.vmap(lambda key: sample_token(
      jnp.asarray(logits), key, 1.0, jnp.asarray(top_p)))(
          jax.random.split(jax.random.key(0), 200))
  assert kept[np.arange(5), np.asarray(tokens)].all()


def test_greedy_cached_decoding_equals_recomputation(model):
  sampler = Sampler(model, SamplingConfig(temperature=0.0, max_new_tokens=6),
                    buckets=(8, 16))
  out = sampler(PROMPTS, jax.random.key(0))
  rows = [list(p) for p in PROMPTS]
  for step in range(6):  # Step-by-step argmax of full recomputation.
    logits, _ = _full_logits(model, rows)
    for r, row in enumerate(rows):
      row.append(int(np.argmax(logits[r, -1])))
  expected = np.array([row[len(p):] for row, p in zip(rows, PROMPTS)])
  np.testing.assert_array_equal(out.tokens, expected)
  assert out.lengths.tolist() == [6, 6, 6]


@pytest.mark.parametrize("temperature,top_p", [(0.8, 0.9), (1.3, 1.0)])
def test_logprobs_equal_recomputed_logprobs(model, temperature, top_p):
  sampler = Sampler(model, SamplingConfig(temperature=temperature,
                                          top_p=top_p, max_new_tokens=5),
                    buckets=(8,))
  out = sampler(PROMPTS, jax.random.key(3))
  rows = [list(p) + c for p, c in zip(PROMPTS, out.completions())]
  logits, length = _full_logits(model, rows)
  for r, (prompt, completion) in enumerate(zip(PROMPTS, out.completions())):
    start = length - len(rows[r])  # Left padding offset.
    for i, token in enumerate(completion):
      position = start + len(prompt) + i - 1
      logp = jax.nn.log_softmax(logits[r, position] / temperature)[token]
      assert out.logprobs[r, i] == pytest.approx(float(logp), abs=1e-5)


def test_scanned_and_unrolled_decode_loops_agree():
  """Both layer loops of cached decoding (`decode_loop`) on the same
  weights: same sampled tokens, log-probs within 1e-6, and the unrolled
  sampler hands back a stacked cache it reuses on the next call."""
  outputs = {}
  for loop in ("scan", "unrolled"):
    model = Qwen3(preset("tiny", vocab_size=64, max_position_embeddings=256,
                         decode_loop=loop), rngs=nnx.Rngs(0))
    sampler = Sampler(model, SamplingConfig(temperature=1.0, top_p=0.9,
                                            max_new_tokens=7), buckets=(8,))
    outputs[loop] = [sampler(PROMPTS, jax.random.key(k)) for k in (1, 1)]
    prompt_cache, cache = sampler._caches[(3, 8, 3, 7)]
    assert prompt_cache.keys.shape[0] == cache.keys.shape[0] == 2  # [L, ...]
  scan, unrolled = outputs["scan"][0], outputs["unrolled"][1]
  np.testing.assert_array_equal(scan.tokens, unrolled.tokens)
  np.testing.assert_array_equal(scan.lengths, unrolled.lengths)
  np.testing.assert_allclose(scan.logprobs, unrolled.logprobs, atol=1e-6)


def test_a_sampler_over_several_cpu_devices_decodes_on_one():
  """CPU devices share the host's memory: a sampler over a mesh of them
  decodes on its first device from one gathered copy of the weights (not
  the weights, layer copies and KV cache once per device), with the same
  tokens as a one-device sampler."""
  from cmimem_jax.parallel import make_mesh
  from cmimem_jax.rl import GRPOLossConfig, Learner, TrainStepConfig
  model = Qwen3(preset("tiny", vocab_size=64, max_position_embeddings=256),
                rngs=nnx.Rngs(0))
  config = SamplingConfig(temperature=1.0, top_p=0.9, max_new_tokens=5)
  want = Sampler(model, config, buckets=(8,))(PROMPTS, jax.random.key(3))
  mesh = make_mesh("fsdp:2", devices=jax.devices()[:2])
  # The learner's fsdp-sharded weights, as a trainer hands them over.
  sharded = Learner(model, TrainStepConfig(loss=GRPOLossConfig(kl_beta=0.0)),
                    mesh).model
  sampler = Sampler(sharded, config, buckets=(8,), mesh=mesh)
  assert {len(x.sharding.device_set)
          for x in jax.tree.leaves(nnx.state(sampler.model))} == {1}
  assert sampler.unrolled == model.config.unrolled_decode
  got = sampler(PROMPTS, jax.random.key(3))
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)
  # A trainer frees that copy before its update and hands the new weights
  # over after it.
  copies = len(jax.tree.leaves(nnx.state(sampler.model)))
  gc.collect()
  live = len(jax.live_arrays())
  sampler.release_weights()
  gc.collect()
  assert len(jax.live_arrays()) == live - copies
  with pytest.raises(RuntimeError, match="set_model first"):
    sampler(PROMPTS, jax.random.key(3))
  sampler.set_model(sharded)
  again = sampler(PROMPTS, jax.random.key(3))
  np.testing.assert_array_equal(again.tokens, want.tokens)


@pytest.mark.parametrize("prompts", [4, 3])
def test_mesh_decoding_splits_the_rows_and_caches_and_samples_as_one_device(
    prompts):
  """decode_devices="mesh" over data:2 x fsdp:4 with the learner's sharded
  weights (as a trainer hands them over): every KV cache leaf is split
  over the 8 batch shards (each device holds 1/8 of its bytes), the
  weights are the learner's own arrays (no copy), and the tokens and
  log-probs equal one-device decoding of the same rows and key. 3
  prompts: padded to 8 on the mesh, the padding dropped."""
  from cmimem_jax.parallel import BATCH_AXES, make_mesh
  from cmimem_jax.rl import GRPOLossConfig, Learner, TrainStepConfig
  model = Qwen3(preset("tiny", vocab_size=64, max_position_embeddings=256),
                rngs=nnx.Rngs(0))
  config = SamplingConfig(temperature=1.0, top_p=0.9, max_new_tokens=5)
  rows = [p for p in (PROMPTS + [[7, 7]])[:prompts] for _ in range(4)]
  want = Sampler(model, config, buckets=(8,))(rows, jax.random.key(3))
  mesh = make_mesh("data:2,fsdp:4")
  sharded = Learner(model, TrainStepConfig(loss=GRPOLossConfig(kl_beta=0.0)),
                    mesh).model
  sampler = Sampler(sharded, config, buckets=(8,), mesh=mesh,
                    decode_devices="mesh")
  assert sampler.model is sharded and sampler.row_shards == 8
  got = sampler(rows, jax.random.key(3))
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(got.lengths, want.lengths)
  np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)
  np.testing.assert_array_equal(got.prompt_tokens, want.prompt_tokens)
  (shape, caches), = sampler._caches.items()
  assert shape == (8, 8, 32, 5)  # 8 prompts (padded), 32 rows.
  # Split where they are allocated, where the program takes them (donated,
  # updated in place) and as it hands them back for the next call.
  fresh = [sampler._zeros(8, 8), sampler._zeros(32, 5)]
  (arguments, _) = sampler.lower(len(rows), 8, 5, group=4).compile(
  ).input_shardings
  assert all(BATCH_AXES in s.spec for s in jax.tree.leaves(arguments[3:5]))
  for leaf in jax.tree.leaves((caches, fresh)):
    assert BATCH_AXES in leaf.sharding.spec
    assert len(leaf.sharding.device_set) == 8
    assert {s.data.nbytes for s in leaf.addressable_shards} == {
        leaf.nbytes // 8}
  with pytest.raises(ValueError, match="decode_devices"):
    Sampler(model, config, mesh=mesh, decode_devices="all")


def test_fixed_key_is_reproducible_and_keys_differ(model):
  sampler = Sampler(model, SamplingConfig(temperature=1.0, top_p=1.0,
                                          max_new_tokens=8), buckets=(8,))
  a = sampler(PROMPTS, jax.random.key(7))
  b = sampler(PROMPTS, jax.random.key(7))
  c = sampler(PROMPTS, jax.random.key(8))
  np.testing.assert_array_equal(a.tokens, b.tokens)
  assert not np.array_equal(a.tokens, c.tokens)


def test_eos_and_stop_sequences(model):
  greedy = Sampler(model, SamplingConfig(temperature=0.0, max_new_tokens=6),
                   buckets=(8,))
  first = greedy(PROMPTS, jax.random.key(0))
  eos = int(first.tokens[0, 2])  # Row 0 emits this at step 2.
  stopped = Sampler(model, SamplingConfig(temperature=0.0, max_new_tokens=6,
                                          eos_ids=(eos,)), buckets=(8,))
  out = stopped(PROMPTS, jax.random.key(0))
  assert out.lengths[0] == list(first.tokens[0]).index(eos) + 1
  assert (out.tokens[0, out.lengths[0]:] == 0).all()
  assert (out.logprobs[0, out.lengths[0]:] == 0).all()
  row = [int(t) for t in first.tokens[1]]
  seq = row[1:3]
  # The first place the pair occurs decides where row 1 stops.
  end = next(i + 2 for i in range(5) if row[i:i + 2] == seq)
  by_stop = Sampler(model, SamplingConfig(temperature=0.0, max_new_tokens=6),
                    buckets=(8,), stop_sequences=[seq])(PROMPTS,
                                                        jax.random.key(0))
  assert by_stop.lengths[1] == end
  np.testing.assert_array_equal(by_stop.tokens[1, :end], row[:end])


def test_each_row_stops_at_its_own_stop_sequences(model):
  """`row_stop_shape`: every call takes a `[B, slots, tokens]` table (one
  compiled shape); each row stops at its own sequences, a row without any
  runs to its budget, a sequence longer than the table is left out."""
  plain = Sampler(model, SamplingConfig(temperature=0.0, max_new_tokens=6),
                  buckets=(8,))
  first = plain(PROMPTS, jax.random.key(0))
  rows = [[int(t) for t in first.tokens[i]] for i in range(len(PROMPTS))]
  per_row = Sampler(model, SamplingConfig(temperature=0.0, max_new_tokens=6),
                    buckets=(8,), row_stop_shape=(2, 2))
  stops = [[rows[0][1:3]], [], [rows[2][2:3], [1, 2, 3]]]
  out = per_row.generate(PROMPTS, jax.random.key(0), 0.0, 1.0, 6,
                         row_stops=stops)
  end0 = next(i + 2 for i in range(5) if rows[0][i:i + 2] == rows[0][1:3])
  assert out.lengths[0] == end0
  assert out.lengths[1] == 6
  assert out.lengths[2] == rows[2].index(rows[2][2]) + 1
  np.testing.assert_array_equal(out.tokens[0, :end0], rows[0][:end0])
  # Without stops, the same tokens as the plain sampler.
  none = per_row.generate(PROMPTS, jax.random.key(0), 0.0, 1.0, 6)
  np.testing.assert_array_equal(none.tokens, first.tokens)
  with pytest.raises(ValueError, match="need a sampler made with"):
    plain.generate(PROMPTS, jax.random.key(0), 0.0, 1.0, 6, row_stops=stops)


def test_prompt_too_long(model):
  sampler = Sampler(model, SamplingConfig(max_new_tokens=4), buckets=(4,))
  with pytest.raises(ValueError, match="exceeds the largest bucket"):
    sampler([[1] * 5], jax.random.key(0))


def test_new_temperatures_and_top_ps_reuse_one_compiled_program(model,
                                                                 compiles):
  sampler = Sampler(model, SamplingConfig(max_new_tokens=4), buckets=(8,))
  sampler.generate(PROMPTS, jax.random.key(0), 0.7, 0.9, 4)  # Warm-up.
  before = compiles.count
  for temperature, top_p in [(0.0, 1.0), (1.3, 0.5), (0.2, 1.0), (2.0, 0.99)]:
    sampler.generate(PROMPTS, jax.random.key(1), temperature, top_p, 4)
  sampler.generate(PROMPTS, jax.random.key(1), [0.0, 0.5, 1.0],
                   [1.0, 0.8, 0.3], 4)
  assert compiles.count == before


def test_per_row_sampling_parameters_match_single_setting_calls(model):
  sampler = Sampler(model, SamplingConfig(max_new_tokens=5), buckets=(8,))
  greedy = sampler.generate(PROMPTS, jax.random.key(0), 0.0, 1.0, 5)
  hot = sampler.generate(PROMPTS, jax.random.key(4), 1.2, 0.7, 5)
  mixed = sampler.generate(PROMPTS, jax.random.key(4), [0.0, 1.2, 0.0],
                           [1.0, 0.7, 1.0], 5)
  # Greedy rows ignore the key; the sampled row draws from the same key
  # stream, so each row equals its single-setting call.
  for row, expected in ((0, greedy), (1, hot), (2, greedy)):
    np.testing.assert_array_equal(mixed.tokens[row], expected.tokens[row])
    np.testing.assert_allclose(mixed.logprobs[row], expected.logprobs[row],
                               atol=1e-6)
  with pytest.raises(ValueError, match="top_p in"):
    sampler.generate(PROMPTS, jax.random.key(0), 1.0, [1.0, 0.0, 1.0], 5)


def test_kv_buffers_are_bounded_least_recently_used_first(model):
  sampler = Sampler(model, SamplingConfig(temperature=0.0, max_new_tokens=2),
                    buckets=(8,), max_cached_shapes=2)
  for rows in (1, 2, 3, 2):
    sampler(PROMPTS[:rows], jax.random.key(0))
  assert list(sampler._caches) == [(3, 8, 3, 2), (2, 8, 2, 2)]
  # A trainer frees them before its update; the next call reallocates.
  before = sampler(PROMPTS[:2], jax.random.key(0))
  sampler.release_caches()
  assert not sampler._caches
  after = sampler(PROMPTS[:2], jax.random.key(0))
  np.testing.assert_array_equal(before.tokens, after.tokens)
  # A trainer drops the start-up's programs before its first step: the
  # next call compiles again and samples the same tokens.
  programs = _generate.jitted_fn._cache_size()
  assert programs >= 2
  sampler.release_programs()
  assert _generate.jitted_fn._cache_size() == 0 and not sampler._caches
  again = sampler(PROMPTS[:2], jax.random.key(0))
  np.testing.assert_array_equal(before.tokens, again.tokens)
  assert _generate.jitted_fn._cache_size() == 1


def test_row_budgets_stop_each_row_at_its_own_length(model, compiles):
  sampler = Sampler(model, SamplingConfig(max_new_tokens=6), buckets=(8,))
  full = sampler.generate(PROMPTS, jax.random.key(0), 0.0, 1.0, 6)
  before = compiles.count
  cut = sampler.generate(PROMPTS, jax.random.key(0), 0.0, 1.0, 6,
                         row_budgets=[2, 6, 1])
  assert compiles.count == before  # Budgets are traced values.
  for row, budget in enumerate([2, 6, 1]):
    length = min(budget, int(full.lengths[row]))
    assert cut.lengths[row] == length
    np.testing.assert_array_equal(cut.tokens[row, :length],
                                  full.tokens[row, :length])
  with pytest.raises(ValueError, match=r"row budgets must be in \[1, 6\]"):
    sampler.generate(PROMPTS, jax.random.key(0), 0.0, 1.0, 6,
                     row_budgets=[7, 1, 1])


@pytest.mark.parametrize("loop", ["scan", "unrolled"])
def test_shared_prompt_rollouts_equal_per_row_rollouts(loop):
  """A GRPO batch (N = 4 rollouts of each of 3 prompts): prefilled once per
  prompt and decoded over the shared prompt cache, it samples exactly the
  tokens of the per-row sampler (a prompt copy per row), log-probs within
  1e-6, at every temperature and stopping row."""
  model = Qwen3(preset("tiny", vocab_size=64, max_position_embeddings=256,
                       decode_loop=loop), rngs=nnx.Rngs(0))
  rows = [p for p in PROMPTS for _ in range(4)]
  temperature = np.tile([0.0, 0.7, 1.0, 1.5], 3)
  budgets = np.tile([7, 3, 7, 5], 3)
  out = {}
  for share in (True, False):
    sampler = Sampler(model, SamplingConfig(max_new_tokens=7, eos_ids=(9,)),
                      buckets=(8,), share_prompts=share)
    out[share] = sampler.generate(rows, jax.random.key(5), temperature, 0.9,
                                  7, budgets)
    prompt_rows = next(iter(sampler._caches))[0]
    assert prompt_rows == (3 if share else 12)
  np.testing.assert_array_equal(out[True].tokens, out[False].tokens)
  np.testing.assert_array_equal(out[True].lengths, out[False].lengths)
  np.testing.assert_array_equal(out[True].prompt_tokens,
                                out[False].prompt_tokens)
  np.testing.assert_allclose(out[True].logprobs, out[False].logprobs,
                             atol=1e-6)
  # The rollouts of a prompt differ (the shared cache is only the prompt's).
  assert len({tuple(t) for t in out[True].tokens[1:4]}) > 1


def test_shared_prompt_group_needs_whole_groups():
  assert shared_prompt_group([[1], [1], [2], [2]]) == 2
  assert shared_prompt_group([[1], [1], [1], [2], [2], [2]]) == 3
  assert shared_prompt_group([[1], [1], [2]]) == 1
  assert shared_prompt_group([[1], [1], [2], [3]]) == 1
  assert shared_prompt_group([[1], [2]]) == 1


def test_waves_of_whole_groups_give_the_unwaved_greedy_rollouts(model):
  rows = [p for p in PROMPTS for _ in range(4)]
  config = SamplingConfig(temperature=0.0, max_new_tokens=5)
  whole = Sampler(model, config, buckets=(8,))(rows, jax.random.key(0))
  waved = Sampler(model, config, buckets=(8,), max_rows_per_wave=5)
  out = waved(rows, jax.random.key(0))
  # 5 rows round down to one group of 4: three waves of one prompt each.
  assert sorted(waved._caches) == [(1, 8, 4, 5)]
  np.testing.assert_array_equal(out.tokens, whole.tokens)
  np.testing.assert_array_equal(out.prompt_tokens, whole.prompt_tokens)
  np.testing.assert_allclose(out.logprobs, whole.logprobs, atol=1e-6)
  with pytest.raises(ValueError, match="max_rows_per_wave"):
    Sampler(model, config, max_rows_per_wave=-1)


@pytest.mark.parametrize("ahead", [True, False])
def test_waves_come_one_at_a_time_as_generate_samples_them(model, ahead):
  """`generate_waves`: each wave's rows in order, together `generate`'s
  sampled output for the same key; with `ahead` the next wave is
  dispatched before the caller gets this one (it decodes while the caller
  scores), without only when the caller asks for it."""
  rows = [p for p in PROMPTS for _ in range(4)]
  config = SamplingConfig(temperature=1.0, max_new_tokens=5)
  sampler = Sampler(model, config, buckets=(8,), max_rows_per_wave=4)
  whole = sampler.generate(rows, jax.random.key(3), 1.0, 0.9, 5)
  dispatched = []
  dispatch = sampler._dispatch_wave
  sampler._dispatch_wave = lambda *args: (dispatched.append(len(args[0])),
                                          dispatch(*args))[1]
  waves, seen = [], []
  for wave in sampler.generate_waves(rows, jax.random.key(3), 1.0, 0.9, 5,
                                     ahead=ahead):
    seen.append(len(dispatched))
    waves.append(wave)
  assert [len(w.lengths) for w in waves] == [4, 4, 4]
  assert seen == ([2, 3, 3] if ahead else [1, 2, 3])
  for field in ("tokens", "lengths", "prompt_tokens", "prompt_mask"):
    np.testing.assert_array_equal(
        np.concatenate([getattr(w, field) for w in waves]),
        getattr(whole, field))
  np.testing.assert_array_equal(
      np.concatenate([w.logprobs for w in waves]), whole.logprobs)
