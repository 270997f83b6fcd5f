"""Every attention backend equals a direct softmax(q·kᵀ/√d)·v, forward and
gradients, with GQA, left padding and packed rows (splash in Pallas
interpret mode on this CPU)."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from cmimem_jax.models import attention
from cmimem_jax.models.qwen3 import Qwen3, positions_from_mask, preset
from cmimem_jax.testing import run_tool
from cmimem_jax.testing.hf_models import left_padded_batch

B, T, HEADS, KV, DIM = 3, 200, 4, 2, 32


def _segments() -> np.ndarray:
  """Row 0: left padding; row 1: two packed segments and tail padding;
  row 2: full."""
  ids = np.ones((B, T), np.int32)
  ids[0, :70] = 0
  ids[1, 90:] = 2
  ids[1, 180:] = 0
  return ids


def _direct(q, k, v, segment_ids):
  """Dense reference: every (query, key) pair, float32."""
  group = q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
  scores = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
  pos = jnp.arange(q.shape[1])
  visible = ((pos[:, None] >= pos[None, :])[None] &
             (segment_ids[:, :, None] == segment_ids[:, None, :]))
  scores = jnp.where(visible[:, None], scores, -jnp.inf)
  return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, -1), v)


def _inputs(seed=0):
  keys = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(keys[0], (B, T, HEADS, DIM))
  k = jax.random.normal(keys[1], (B, T, KV, DIM))
  v = jax.random.normal(keys[2], (B, T, KV, DIM))
  target = jax.random.normal(keys[3], (B, T, HEADS, DIM))
  return q, k, v, target


BACKENDS = {
    "per_head": lambda q, k, v, s: attention.causal_self_attention(
        q, k, v, s, "per_head"),
    "batched": lambda q, k, v, s: attention.causal_self_attention(
        q, k, v, s, "batched"),
    "splash": lambda q, k, v, s: attention.causal_self_attention(
        q, k, v, s, "splash"),
}


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_backend_matches_direct_attention_forward_and_gradients(name):
  q, k, v, target = _inputs()
  segments = jnp.asarray(_segments())
  real = (segments != 0)[:, :, None, None]

  def loss(fn, q, k, v):
    # Padding outputs are unspecified: only real tokens enter the loss.
    return jnp.sum(jnp.where(real, fn(q, k, v, segments) * target, 0.0))

  want = _direct(q, k, v, segments)
  got = BACKENDS[name](q, k, v, segments)
  np.testing.assert_allclose(np.where(real, got, 0), np.where(real, want, 0),
                             atol=1e-5)
  grads = jax.grad(loss, argnums=(1, 2, 3))
  for g, w in zip(grads(BACKENDS[name], q, k, v), grads(_direct, q, k, v)):
    np.testing.assert_allclose(g, w, atol=1e-5)


def test_cudnn_row_rolling_matches_direct_attention():
  """The cuDNN path's roll-to-lengths logic, run by XLA's implementation of
  the same call (cuDNN itself needs a GPU)."""
  q, k, v, _ = _inputs(1)
  segments = _segments()
  segments[1, 90:180] = 1  # One segment per row, as cuDNN requires.
  segments = jnp.asarray(segments)
  got = attention._cudnn_causal(q, k, v, segments, implementation="xla")
  want = _direct(q, k, v, segments)
  real = np.asarray(segments != 0)[:, :, None, None]
  np.testing.assert_allclose(np.where(real, got, 0), np.where(real, want, 0),
                             atol=1e-5)


def test_splash_under_a_mesh_equals_one_device():
  if len(jax.devices()) < 8:
    pytest.skip("needs the 8 fake CPU devices set up in conftest")
  q, k, v, _ = _inputs(2)
  q, k, v = (jnp.concatenate([x, x[:1]]) for x in (q, k, v))  # 4 rows.
  segments = jnp.asarray(np.concatenate([_segments(), _segments()[:1]]))
  single = attention.causal_self_attention(q, k, v, segments, "splash")
  mesh = Mesh(np.array(jax.devices()).reshape(2, 2, 2),
              ("data", "fsdp", "tensor"))
  with jax.set_mesh(mesh):
    sharded = jax.jit(lambda *a: attention.causal_self_attention(
        *a, "splash"))(q, k, v, segments)
  np.testing.assert_allclose(sharded, single, atol=1e-6)
  with jax.set_mesh(Mesh(np.array(jax.devices()[:3]), ("fsdp",))):
    with pytest.raises(ValueError, match="must divide"):
      attention.causal_self_attention(q, k, v, segments, "splash")


def test_auto_resolves_by_target_platform_and_dtype():
  assert attention.resolve_impl("auto", 1, jnp.float32) == "batched"
  assert attention.resolve_impl("auto", 64, jnp.float32) == "per_head"
  assert attention.resolve_impl("splash", 1, jnp.float32) == "splash"
  with pytest.raises(ValueError, match="attention_impl"):
    attention.resolve_impl("flash", 1, jnp.float32)


def test_whole_model_with_splash_equals_the_xla_path():
  tokens, mask = left_padded_batch(64, [9, 130, 60], 130)
  positions = positions_from_mask(mask)
  logits = {}
  for impl in ("splash", "per_head"):
    model = Qwen3(preset("tiny", vocab_size=64, attention_impl=impl),
                  rngs=nnx.Rngs(0))
    logits[impl] = np.asarray(model(tokens, positions, mask)[0])
  real = mask.astype(bool)
  np.testing.assert_allclose(logits["splash"][real], logits["per_head"][real],
                             atol=1e-5)


def test_shared_prefix_mask_tiles_equal_the_dense_mask():
  """Prompt causal; a row over the whole prompt and causally over itself,
  never another row; every tile (fast-pathed or not) equal to the dense
  definition."""
  prompt, row, groups = 8, 4, 3
  length = prompt + groups * row
  mask = attention.shared_prefix_mask(length, prompt, row)
  q, kv = np.arange(length)[:, None], np.arange(length)[None]
  region = lambda x: np.where(x < prompt, -1, (x - prompt) // row)  # noqa
  dense = (kv <= q) & ((kv < prompt) | (region(q) == region(kv)))
  assert mask.shape == (length, length)
  for block in (4, 2, 3):
    for i in range(0, length, block):
      for j in range(0, length, block):
        np.testing.assert_array_equal(
            mask[i:i + block, j:j + block], dense[i:i + block, j:j + block])
  assert mask == attention.shared_prefix_mask(length, prompt, row)
  assert hash(mask) == hash(attention.shared_prefix_mask(length, prompt, row))
  assert mask != attention.shared_prefix_mask(length, prompt - 4, row + 2)


def test_shared_prompt_train_step_compiles_for_a_v5p_8():
  """The packed shared-prompt update lowers the splash kernel for a TPU
  (Mosaic, not interpret mode): `tools/compile_shared_prompt.py` on a
  tiny model."""
  pytest.importorskip("libtpu", reason="the TPU extra is not installed")
  from tools import compile_shared_prompt
  row = run_tool(compile_shared_prompt, [
      "--preset=tiny", "--rows=8", "--prompt=200", "--completion=100",
      "--group=2"])
  assert row["tpu_kernels"] > 0 and 0 < row["total_gib"] < 1
  assert row["packed_tokens_per_chip"] == 200 + 2 * 100
