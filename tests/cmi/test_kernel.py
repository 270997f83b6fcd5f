import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cmimem_jax.cmi import kernel, residual_cmi, residual_cmi_unchecked
from cmimem_jax.cmi.kernel import _small_program

from reference import residual_cmi_reference  # noqa: I100


def _inputs(rng, batch, n, d, mask_prob=0.8):
  return (rng.normal(size=(batch, d)).astype(np.float32),
          rng.normal(size=(batch, d)).astype(np.float32),
          rng.normal(size=(batch, n, d)).astype(np.float32),
          rng.random((batch, n)) < mask_prob)


def _check(inputs, atol, **kwargs):
  got = np.asarray(residual_cmi(*inputs, **kwargs))
  want = residual_cmi_reference(*inputs, **kwargs)
  assert got.dtype == np.float32 and got.shape == want.shape
  np.testing.assert_allclose(got, want, atol=atol, rtol=0)
  return got


@pytest.fixture(params=["matmul", "lanes", "blocks"])
def kernel_path(request, monkeypatch):
  """Runs a test on each of the kernel's CPU paths: one program of batched
  matmuls (small work) and separate programs of lane reductions (large
  work), strided or blocked (many memories), the latter two forced on
  small shapes."""
  if request.param != "matmul":
    monkeypatch.setattr(kernel, "SMALL_WORK", 0)
  if request.param == "blocks":
    monkeypatch.setattr(kernel, "BLOCKED_MIN_N", 0)
  return request.param


@pytest.mark.parametrize("n,d", [(0, 16), (1, 16), (2, 8), (8, 384), (20, 64)])
def test_random_inputs(n, d, kernel_path):
  del kernel_path
  _check(_inputs(np.random.default_rng(n), 64, n, d), atol=1e-5)


def test_a_call_uses_one_form_for_all_its_products(kernel_path):
  # A batched matmul among lane reductions slows their program by more
  # than it takes alone: the products of one call share one form.
  queries = jnp.zeros((4, 2, 16))
  mem = jnp.zeros((4, 3, 16))
  form = kernel._form(mem)
  text = str(jax.make_jaxpr(lambda q, m: (
      kernel._products(q, m, form),
      kernel._anchored_products(m, q, form)))(queries, mem))
  matmuls = text.count("dot_general")
  assert matmuls == (5 if kernel_path == "matmul" else 0)


@pytest.mark.parametrize("form", ["matmul", "lanes", "blocks"])
def test_a_query_equal_to_a_memory_has_bitwise_its_gram_row(form):
  # The anchored solve of a repeated memory relies on it (module doc).
  # At d = 384 (real embeddings); at d = 64 or 128 XLA's reductions of
  # different shapes differ in their last bit (both lane forms).
  rng = np.random.default_rng(8)
  mem = jnp.asarray(rng.normal(size=(3, 5, 384)), jnp.float32)
  queries = jnp.stack([jnp.asarray(rng.normal(size=(3, 384)), jnp.float32),
                       mem[:, 3]], axis=1)
  products = jax.jit(kernel._products, static_argnums=2)(queries, mem, form)
  np.testing.assert_array_equal(products.alignment[:, 1], products.gram[:, 3])
  np.testing.assert_array_equal(products.qq[:, 1, 1], products.gram[:, 3, 3])


def test_mixed_masks_in_one_batch_compile_once():
  rng = np.random.default_rng(1)
  e_c, e_n, mem, _ = _inputs(rng, 12, 6, 32)
  mask = np.zeros((12, 6), bool)
  for row in range(12):  # 0..6 valid memories, scattered positions
    mask[row, rng.permutation(6)[: row % 7]] = True
  before = _small_program._cache_size()
  got = _check((e_c, e_n, mem, mask), atol=1e-5)
  # Rows under min_memories take the cosine fallback.
  few = mask.sum(1) < 2
  cos = np.sum(e_c * e_n, 1) / np.linalg.norm(e_c, axis=1) / np.linalg.norm(e_n, axis=1)
  np.testing.assert_allclose(got[few], cos[few], atol=1e-6)
  mask2 = rng.random((12, 6)) < 0.5
  _check((e_c, e_n, mem, mask2), atol=1e-5)
  _check((e_c, e_n, mem, mask2), atol=1e-5, min_memories=3, lam=1e-3)
  assert _small_program._cache_size() - before == 1


def test_device_inputs_sharded_or_not_match_host_inputs():
  # Device arrays skip the host conversion and the λ / min_memories
  # scalars are cached per value: neither may change a result, and the
  # cached scalars must follow inputs sharded over several devices.
  inputs = _inputs(np.random.default_rng(3), 16, 4, 32)
  want = _check(inputs, atol=1e-5, lam=2e-4)
  on_device = [jnp.asarray(x) for x in inputs]
  np.testing.assert_array_equal(
      np.asarray(residual_cmi(*on_device, lam=2e-4)), want)
  mesh = jax.make_mesh((2,), ("batch",), devices=jax.devices()[:2])
  sharded = [jax.device_put(x, jax.NamedSharding(
      mesh, jax.P("batch", *([None] * (x.ndim - 1))))) for x in on_device]
  np.testing.assert_allclose(
      np.asarray(residual_cmi(*sharded, lam=2e-4)), want, atol=1e-6)
  # A device array of another dtype is still computed in float32.
  half = jnp.asarray(inputs[2], jnp.bfloat16)
  np.testing.assert_allclose(
      np.asarray(residual_cmi(*on_device[:2], half, on_device[3])),
      residual_cmi_reference(*inputs[:2], np.asarray(half, np.float32),
                             inputs[3]), atol=1e-5)
  # An integer-valued λ is the same traced float32 scalar.
  np.testing.assert_allclose(np.asarray(residual_cmi(*on_device, lam=1)),
                             residual_cmi_reference(*inputs, lam=1.0),
                             atol=1e-5)


def test_realistic_embeddings():
  """Embeddings of real encoders share a mean direction and live near a
  low-dimensional subspace; the test encoder gives such vectors for text."""
  from cmimem_jax.encoders import HashingEncoder
  encoder = HashingEncoder(256)
  texts = [f"Caroline went to the {w} on day {i}" for i, w in enumerate(
      ["park", "gym", "lake", "support group", "museum", "beach"] * 5)]
  vectors = encoder.encode(texts)
  rng = np.random.default_rng(2)
  picks = np.stack([rng.permutation(len(texts))[:10] for _ in range(16)])
  # Distinct memories; context and fragment are other texts (degenerate
  # overlaps are tested separately).
  inputs = (vectors[picks[:, 8]], vectors[picks[:, 9]], vectors[picks[:, :8]],
            np.ones((16, 8), bool))
  _check(inputs, atol=1e-5)


def test_degenerate_inputs(kernel_path):
  del kernel_path
  rng = np.random.default_rng(3)
  e_c, e_n, mem, _ = _inputs(rng, 64, 8, 64)
  full = np.ones((64, 8), bool)
  dup = mem.copy()
  dup[:, 1] = dup[:, 0]
  dup[:, 2] = 3 * dup[:, 0]  # Same direction, other scale.
  _check((e_c, e_n, dup, full), atol=1e-4)
  zeros = mem.copy()
  zeros[:, :3] = 0.0  # Zero memories behave like masked ones.
  _check((e_c, e_n, zeros, full), atol=1e-4)
  np.testing.assert_allclose(
      residual_cmi(e_c, e_n, zeros, full),
      residual_cmi(e_c, e_n, mem, (np.arange(8) >= 3) & full), atol=1e-6)
  # e_new equal to a stored memory: its residual is ~λ, not 0.
  same = mem[:, 5].copy()
  got = _check((e_c, same, mem, full), atol=1e-5)  # Anchored solve: ~1e-6.
  assert np.all(np.abs(got) < 0.05)
  # Worst case: the repeated memory is itself stored three times (G is
  # rank-deficient up to λ). float32 then resolves the ~λ/3 residual to
  # ~1e-4 (see kernel docstring).
  _check((e_c, dup[:, 0].copy(), dup, full), atol=1e-3)
  # Zero context or fragment: rho 0, not NaN.
  zero = np.zeros_like(e_c)
  assert np.all(np.asarray(residual_cmi(zero, e_n, mem, full)) == 0)
  assert np.all(np.asarray(residual_cmi(zero, e_n, mem, ~full)) == 0)
  # e_new == e_ctx with no memories: cosine 1.
  np.testing.assert_allclose(residual_cmi(e_c, e_c, mem, ~full), 1, atol=1e-6)


@pytest.mark.parametrize("anchored_rows", [0, 5, 40])
def test_some_rows_anchored(anchored_rows, kernel_path, monkeypatch):
  # The large path runs the anchored d-space pass over the anchored rows
  # only: gathered while few (5 of 64), over the whole batch when many
  # (40); the other rows take stage 1's products.
  gathered = []
  gather = kernel._anchored_rows
  monkeypatch.setattr(kernel, "_anchored_rows",
                      lambda *args: gathered.append(args) or gather(*args))
  rng = np.random.default_rng(5)
  e_c, e_n, mem, mask = _inputs(rng, 64, 8, 64)
  mask[:, :3] = True
  rows = rng.permutation(64)[:anchored_rows]
  e_n[rows[::2]] = mem[rows[::2], 1]  # Stored: a residual of ~λ.
  e_c[rows[1::2]] = mem[rows[1::2], 2] + 1e-3 * rng.normal(size=(
      len(rows[1::2]), 64)).astype(np.float32)  # Nearly stored.
  got = _check((e_c, e_n, mem, mask), atol=1e-5)
  assert bool(gathered) == (kernel_path != "matmul" and anchored_rows == 5)
  # A row's value does not depend on which rows share its batch.
  alone = np.asarray(residual_cmi(e_c[rows], e_n[rows], mem[rows],
                                  mask[rows]))
  np.testing.assert_allclose(got[rows], alone, atol=1e-6)


def test_extreme_but_finite_inputs_stay_finite(kernel_path):
  del kernel_path
  rng = np.random.default_rng(4)
  e_c, e_n, mem, mask = _inputs(rng, 32, 8, 16)
  for scale in (1e-30, 1e30):
    got = np.asarray(residual_cmi(e_c * scale, e_n * scale, mem * scale, mask))
    assert np.all(np.isfinite(got)) and np.all(np.abs(got) <= 1)
  huge = np.full_like(mem, 3e38)
  assert np.all(np.isfinite(np.asarray(residual_cmi(e_c, e_n, huge, mask))))


def test_invalid_inputs_raise_clearly():
  rng = np.random.default_rng(5)
  e_c, e_n, mem, mask = _inputs(rng, 4, 3, 8)
  bad = mem.copy()
  bad[2, 1, 0] = np.nan
  with pytest.raises(ValueError, match=r"mem has NaN/inf values in 1 row\(s\), first rows \[2\]"):
    residual_cmi(e_c, e_n, bad, mask)
  inf = e_n.copy()
  inf[0, 0] = np.inf
  with pytest.raises(ValueError, match="e_new has NaN/inf"):
    residual_cmi(e_c, inf, mem, mask)
  for _ in range(2):  # Shapes are checked once per shape: failures stay.
    with pytest.raises(ValueError, match=r"e_new must be \[4, 8\]"):
      residual_cmi(e_c, e_n[:, :4], mem, mask)
  with pytest.raises(ValueError, match=r"mem must be \[B, N, d\]"):
    residual_cmi(e_c, e_n, mem[0], mask)
  for lam in (0.0, np.float32(-1e-4), jnp.float32(0.0)):
    with pytest.raises(ValueError, match="lam must be positive"):
      residual_cmi(e_c, e_n, mem, mask, lam=lam)


def test_gradients_match_finite_differences():
  rng = np.random.default_rng(6)
  e_c, e_n, mem, mask = (jnp.asarray(x) for x in _inputs(rng, 3, 4, 6))
  mask = mask.at[:, :2].set(True)

  def loss(e_new):
    return jnp.sum(residual_cmi(e_c, e_new, mem, mask) * jnp.arange(1.0, 4.0))

  grad = jax.grad(loss)(e_n)
  assert np.all(np.isfinite(np.asarray(grad)))
  eps = 1e-2
  direction = jnp.asarray(rng.normal(size=e_n.shape), jnp.float32)
  numeric = (loss(e_n + eps * direction) - loss(e_n - eps * direction)) / (2 * eps)
  np.testing.assert_allclose(jnp.sum(grad * direction), numeric, rtol=2e-2,
                             atol=1e-4)
  # Gradients stay finite through masked rows, zero vectors and the guard.
  zero_grad = jax.grad(lambda m: jnp.sum(residual_cmi_unchecked(
      e_c, e_n, m, mask)))(mem.at[:, 0].set(0.0))
  assert np.all(np.isfinite(np.asarray(zero_grad)))


def test_vmap_and_jit_compose():
  rng = np.random.default_rng(7)
  stacks = [np.stack(x) for x in zip(*[_inputs(rng, 5, 4, 8) for _ in range(3)])]
  batched = jax.vmap(residual_cmi_unchecked)(*(jnp.asarray(s) for s in stacks))
  for i in range(3):
    np.testing.assert_allclose(
        batched[i], residual_cmi(*(s[i] for s in stacks)), atol=1e-6)
  jitted = jax.jit(residual_cmi)(*(s[0] for s in stacks))
  np.testing.assert_allclose(jitted, residual_cmi(*(s[0] for s in stacks)),
                             atol=1e-6)


def test_the_readme_example_runs(capsys):
  """docs/design.md's "The CMI kernel" block, run as written."""
  design = (pathlib.Path(__file__).parents[2] / "docs" /
            "design.md").read_text()
  section = design.split("## The CMI kernel", 1)[1]
  (block,) = re.findall(r"```python\n(.*?)```", section.split("\n## ", 1)[0],
                        re.S)
  scope = {}
  exec(block, scope)  # noqa: S102
  rho = np.asarray(scope["rho"])
  assert rho.shape == (4,) and rho.dtype == np.float32
  assert capsys.readouterr().out.startswith("[")  # It prints rho.
  e_ctx, e_new = scope["e_ctx"], scope["e_new"]
  cos = np.sum(e_ctx * e_new, 1) / np.linalg.norm(e_ctx, axis=1) / (
      np.linalg.norm(e_new, axis=1))
  np.testing.assert_allclose(rho[:2], cos[:2], atol=1e-6)  # < 2 memories.
  np.testing.assert_allclose(rho, residual_cmi_reference(
      e_ctx, e_new, scope["mem"], scope["mem_mask"]), atol=1e-5)
