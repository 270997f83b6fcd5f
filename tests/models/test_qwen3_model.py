"""Sharded loading, remat, dtype policy and the reference-comparison tool."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from cmimem_jax.models.qwen3 import (KVCache, Qwen3, load_hf,
                                     positions_from_mask, preset)
from cmimem_jax.testing import run_tool
from cmimem_jax.testing.hf_models import hf_causal_lm, left_padded_batch
from tools import compare_reference


def test_load_onto_a_mesh_with_per_parameter_shardings(tmp_path):
  if len(jax.devices()) < 8:
    pytest.skip("needs the 8 fake CPU devices set up in conftest")
  _, directory = hf_causal_lm(tmp_path, "qwen3", vocab_size=96,
                              intermediate_size=96)
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("fsdp", "tensor"))

  def sharding_fn(path, shape):
    if path == "embed":
      return NamedSharding(mesh, P("tensor", "fsdp"))
    if path.startswith("layers.") and len(shape) == 3:  # [L, in, out]
      return NamedSharding(mesh, P(None, "fsdp", "tensor"))
    return NamedSharding(mesh, P())

  sharded = load_hf(directory, sharding_fn=sharding_fn)
  plain = load_hf(directory)
  assert sharded.embed[...].sharding.spec == P("tensor", "fsdp")
  assert sharded.layers.gate_proj[...].sharding.spec == P(None, "fsdp",
                                                          "tensor")
  assert len(sharded.layers.gate_proj[...].addressable_shards) == 8
  tokens, mask = left_padded_batch(96, [7, 4], 8)
  forward = nnx.jit(lambda m, t, k: m(t, positions_from_mask(k), k),
                    graph=False)
  a, _ = forward(sharded, tokens, mask)
  b, _ = plain(tokens, positions_from_mask(mask), mask)
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_changes_nothing_but_memory(remat):
  config = preset("tiny", vocab_size=64)
  base = Qwen3(config, rngs=nnx.Rngs(0))
  other = Qwen3(preset("tiny", vocab_size=64, remat=remat), rngs=nnx.Rngs(0))
  tokens = jnp.arange(12).reshape(2, 6) % 64

  def loss(model):
    logits, _ = model(tokens)
    return jnp.mean(jax.nn.log_softmax(logits)[..., 0])

  g1 = nnx.grad(loss)(base)
  g2 = nnx.grad(loss)(other)
  for x, y in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6)


def test_attention_implementations_agree_with_padding_and_cache():
  models = {impl: Qwen3(preset("tiny", vocab_size=64, attention_impl=impl),
                        rngs=nnx.Rngs(0)) for impl in ("batched", "per_head")}
  tokens, mask = left_padded_batch(64, [9, 3, 6], 10)
  positions = positions_from_mask(mask)
  full = {impl: np.asarray(m(tokens, positions, mask)[0])
          for impl, m in models.items()}
  np.testing.assert_allclose(full["per_head"], full["batched"], atol=1e-5)
  # Cached path: prefill 8 tokens, then 2 single-token steps.
  stepped = {}
  for impl, m in models.items():
    cache = KVCache.zeros(m.config, 3, 12)
    logits, cache = m(tokens[:, :8], positions[:, :8], mask[:, :8], cache, 0)
    outs = [logits]
    for i in (8, 9):
      logits, cache = m(tokens[:, i:i + 1], positions[:, i:i + 1],
                        mask[:, i:i + 1], cache, i)
      outs.append(logits)
    stepped[impl] = np.concatenate([np.asarray(o) for o in outs], axis=1)
  np.testing.assert_allclose(stepped["per_head"], stepped["batched"],
                             atol=1e-5)
  # The unrolled layer loop over per-layer weights and a per-layer cache.
  m = models["batched"]
  cache = KVCache.zeros(m.config, 3, 12)
  logits, cache = m(tokens[:, :8], positions[:, :8], mask[:, :8], cache, 0)
  cache, layers, outs = cache.per_layer(), m.layer_params(), [logits]
  for i in (8, 9):
    logits, cache = m(tokens[:, i:i + 1], positions[:, i:i + 1],
                      mask[:, i:i + 1], cache, i, layers=layers)
    outs.append(logits)
  unrolled = np.concatenate([np.asarray(o) for o in outs], axis=1)
  np.testing.assert_allclose(unrolled, stepped["batched"], atol=1e-6)
  assert len(cache.keys) == 2 and cache.stacked().keys.shape == (2, 12, 2, 3,
                                                                 24)
  with pytest.raises(ValueError, match="per-layer cache"):
    m(tokens[:, 8:9], positions[:, 8:9], mask[:, 8:9], cache.stacked(), 8,
      layers=layers)
  with pytest.raises(ValueError, match="decode_loop"):
    preset("tiny", decode_loop="loop")
  real = mask.astype(bool)
  np.testing.assert_allclose(stepped["batched"][real], full["batched"][real],
                             atol=1e-5)


def test_bfloat16_compute_keeps_float32_logits():
  model = Qwen3(preset("tiny", vocab_size=64, dtype="bfloat16",
                       param_dtype="bfloat16"), rngs=nnx.Rngs(0))
  reference = Qwen3(preset("tiny", vocab_size=64), rngs=nnx.Rngs(0))
  # Same weights, stored in bfloat16.
  nnx.update(model, jax.tree.map(lambda x: x.astype(jnp.bfloat16),
                                 nnx.state(reference, nnx.Param)))
  tokens = jnp.arange(10).reshape(2, 5)
  logits, _ = model(tokens)
  want, _ = reference(tokens)
  assert logits.dtype == jnp.float32
  assert model.layers.q_proj[...].dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(logits), np.asarray(want), atol=0.05)


def test_compare_reference_tool(tmp_path, capsys):
  _, directory = hf_causal_lm(tmp_path, "llama", tie_word_embeddings=True)
  result = run_tool(compare_reference, ["--hf_checkpoint", directory])
  assert result["kind"] == "causal_lm" and result["max_abs_diff"] < 1e-4
  assert '"max_abs_diff"' in capsys.readouterr().out
  # The splash kernel (interpret mode here) against transformers.
  result = run_tool(compare_reference, ["--hf_checkpoint", directory,
                                        "--attention_impl=splash"])
  assert result["attention_impl"] == "splash"
  assert result["max_abs_diff"] < 1e-4 and result["argmax_agreement"] == 1.0


@pytest.mark.parametrize("remat,impl", [("none", "auto"), ("full", "auto"),
                                        ("full", "splash")])
def test_shared_prompt_hidden_states_equal_the_concatenated_rows(remat, impl):
  """Two prompts (left-padded, lengths 7 and 3) continued by 3 rows each
  (right-padded, one empty): computing each prompt once gives the hidden
  states, and the gradients, of running the 6 whole rows; on the splash
  kernel (TPU's path; interpret mode here) as packed `[prompt; rows]`
  sequences."""
  model = Qwen3(preset("tiny", vocab_size=64, remat=remat,
                       attention_impl=impl), rngs=nnx.Rngs(0))
  prompts, prompt_mask = left_padded_batch(64, [7, 3], 8)
  rng = np.random.default_rng(1)
  group, width = 3, 5
  lengths = np.array([5, 2, 0, 4, 5, 1])
  continuation_mask = (np.arange(width)[None] < lengths[:, None]).astype(
      np.int32)
  continuations = rng.integers(1, 64, (6, width)).astype(
      np.int32) * continuation_mask
  tokens = np.concatenate([np.repeat(prompts, group, 0), continuations], 1)
  mask = np.concatenate([np.repeat(prompt_mask, group, 0),
                         continuation_mask], 1)
  positions = positions_from_mask(mask)
  real = continuation_mask.astype(bool)

  def whole_rows(m):
    hidden, _ = m.hidden_states(tokens, positions, mask)
    return hidden[::group, :8], hidden[:, 8:]

  def shared(m):
    return m.shared_prompt_hidden_states(prompts, prompt_mask, continuations,
                                         positions[:, 8:], continuation_mask)

  (want_prompt, want), (got_prompt, got) = whole_rows(model), shared(model)
  prompt_real = prompt_mask.astype(bool)
  np.testing.assert_allclose(np.asarray(got_prompt)[prompt_real],
                             np.asarray(want_prompt)[prompt_real], atol=1e-5)
  np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real],
                             atol=1e-5)

  def loss(m, forward):
    prompt_hidden, hidden = forward(m)
    return (jnp.sum(jnp.where(real[..., None], jnp.sin(hidden), 0.0))
            + jnp.sum(prompt_hidden[:, -1] ** 2))

  want_grads = nnx.grad(lambda m: loss(m, whole_rows))(model)
  got_grads = nnx.grad(lambda m: loss(m, shared))(model)
  for x, y in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4,
                               atol=1e-4 * float(np.abs(y).max()))
  with pytest.raises(ValueError, match="equal groups"):
    model.shared_prompt_hidden_states(prompts, prompt_mask,
                                      continuations[:5], positions[:5, 8:],
                                      continuation_mask[:5])
