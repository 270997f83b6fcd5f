import numpy as np
import pytest

from cmimem_jax.cmi import residual_cmi
from cmimem_jax.cmi.banked import banked_rho
from cmimem_jax.cmi.conditioning import ConditioningConfig

from reference import residual_cmi_reference  # noqa: I100


def _unit(x):
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _reference_sets(vectors, valid, recent, e_ctx, e_new, e_old, has_old,
                    config):
  """App. F written out per operation in NumPy."""
  sets = []
  v = _unit(vectors.astype(np.float64))
  for b in range(len(vectors)):
    row = []
    for o in range(e_new.shape[1]):
      q = (config.w_context * _unit(e_ctx[b]) + config.w_new * _unit(e_new[b, o])
           + (config.w_old * _unit(e_old[b, o]) if has_old[b, o] else 0))
      scores = np.where(valid[b], v[b] @ q, -np.inf)
      order = [i for i in np.argsort(-scores, kind="stable")
               if np.isfinite(scores[i])][:config.top_k]
      chosen = list(order)
      for r in recent[b][:config.n_recent]:
        if r >= 0 and r not in chosen:
          chosen.append(int(r))
      row.append(chosen)
    sets.append(row)
  return sets


def _bank_inputs(rng, banks=3, entries=40, ops=5, d=32):
  vectors = rng.normal(size=(banks, entries, d)).astype(np.float32)
  valid = np.ones((banks, entries), bool)
  valid[1, 30:] = False  # A smaller bank, padded.
  valid[2, 5:] = False   # Smaller than top_k.
  recent = np.array([[3, 7, -1], [29, 10, 2], [4, -1, -1]])
  e_ctx = rng.normal(size=(banks, d)).astype(np.float32)
  e_new = rng.normal(size=(banks, ops, d)).astype(np.float32)
  e_old = rng.normal(size=(banks, ops, d)).astype(np.float32)
  has_old = rng.random((banks, ops)) < 0.5
  e_new[0, 0] = vectors[0, 3]  # A fragment repeating a stored memory.
  return vectors, valid, recent, e_ctx, e_new, e_old, has_old


def test_conditioning_sets_follow_app_f():
  inputs = _bank_inputs(np.random.default_rng(0))
  config = ConditioningConfig()
  _, _, index, mask = banked_rho(*inputs, config=config)
  index, mask = np.asarray(index), np.asarray(mask)
  want = _reference_sets(*inputs, config)
  for b in range(3):
    for o in range(5):
      got = [int(i) for i, m in zip(index[b, o], mask[b, o]) if m]
      # Top-k in descending similarity, then the unseen recent entries.
      assert got == want[b][o], (b, o)


@pytest.mark.parametrize("top_k,n_recent", [(8, 2), (5, 3)])
def test_banked_equals_kernel_on_gathered_sets(top_k, n_recent):
  vectors, valid, recent, e_ctx, e_new, e_old, has_old = _bank_inputs(
      np.random.default_rng(1))
  config = ConditioningConfig(top_k=top_k, n_recent=n_recent)
  rho_new, rho_old, index, mask = (np.asarray(x) for x in banked_rho(
      vectors, valid, recent, e_ctx, e_new, e_old, has_old, config=config))
  banks, ops, n = index.shape
  gathered = vectors[np.arange(banks)[:, None, None], index]  # [Bk, O, N, d]
  flat = lambda x: x.reshape((banks * ops,) + x.shape[2:])  # noqa: E731
  ctx = np.repeat(e_ctx[:, None], ops, axis=1)
  for fragment, got in ((e_new, rho_new), (e_old, rho_old)):
    want = residual_cmi_reference(flat(ctx), flat(fragment), flat(gathered),
                                  flat(mask))
    np.testing.assert_allclose(got.reshape(-1), want, atol=1e-5)
    kernel = residual_cmi(flat(ctx), flat(fragment), flat(gathered), flat(mask))
    np.testing.assert_allclose(got.reshape(-1), kernel, atol=1e-5)
  # The repeated memory is in its own conditioning set: rho ~ 0.
  assert abs(rho_new[0, 0]) < 0.05


def test_nan_input_raises():
  inputs = list(_bank_inputs(np.random.default_rng(2)))
  inputs[4] = inputs[4].copy()
  inputs[4][1, 2, 3] = np.nan
  with pytest.raises(ValueError, match="e_new has NaN"):
    banked_rho(*inputs)


def test_banks_sharded_over_devices_give_the_same_result():
  import jax
  from jax.sharding import Mesh, NamedSharding, PartitionSpec
  if len(jax.devices()) < 2:
    pytest.skip("needs several (fake) CPU devices")
  rng = np.random.default_rng(4)
  banks, entries, ops, d = 4, 30, 6, 16
  inputs = [rng.normal(size=(banks, entries, d)).astype(np.float32),
            rng.random((banks, entries)) < 0.9,
            np.array([[3, 7], [1, -1], [-1, -1], [0, 2]]),
            rng.normal(size=(banks, d)).astype(np.float32),
            rng.normal(size=(banks, ops, d)).astype(np.float32),
            rng.normal(size=(banks, ops, d)).astype(np.float32),
            rng.random((banks, ops)) < 0.5]
  plain = [np.asarray(x) for x in banked_rho(*inputs)[:2]]
  mesh = Mesh(np.array(jax.devices()[:2]), ("banks",))
  placed = [jax.device_put(x, NamedSharding(
      mesh, PartitionSpec("banks", *([None] * (x.ndim - 1))))) for x in inputs]
  rho_new, rho_old, _, _ = banked_rho(*placed)
  assert rho_new.sharding.spec[0] == "banks" and banks == len(rho_new)
  np.testing.assert_allclose(np.asarray(rho_new), plain[0], atol=1e-6)
  np.testing.assert_allclose(np.asarray(rho_old), plain[1], atol=1e-6)
