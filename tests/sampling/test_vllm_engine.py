"""The vLLM path without vLLM: clear errors, NNX -> HF tensor conversion,
output packing and the JAX log-prob recomputation."""

import os
import subprocess
import sys
import types

import jax
import numpy as np
import pytest
from flax import nnx

from cmimem_jax.config import MissingDependency
from cmimem_jax.models.qwen3 import Qwen3, load_hf, preset
from cmimem_jax.rl import recompute_logprobs
from cmimem_jax.sampling import Sampler, SamplingConfig
from cmimem_jax.sampling.vllm_engine import (INSTALL_HINT, VLLMEngine,
                                             sample_output, vllm_weights)

torch = pytest.importorskip("torch")


REPO = os.path.join(os.path.dirname(__file__), "..", "..")


def _skip_if_vllm_is_installed() -> None:
  try:
    import vllm  # noqa: F401
    pytest.skip("vLLM is installed here")
  except ImportError:
    pass


def test_vllm_absent_gives_the_install_hint():
  _skip_if_vllm_is_installed()
  with pytest.raises(MissingDependency, match="pip install vllm$"):
    VLLMEngine("/nonexistent")
  assert "rollout.engine='jax'" in INSTALL_HINT


def test_train_without_vllm_says_one_line_with_the_install_command(tmp_path):
  """The H20 config's train command where vLLM is absent: exit 2 with one
  line on stderr ending in the pip command (not a 36-line traceback),
  before anything is written or compiled."""
  _skip_if_vllm_is_installed()
  data = tmp_path / "data.json"
  data.write_text("[]")
  (tmp_path / "states").mkdir()
  url = "http://127.0.0.1:9/v1"
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=8")
  env.pop("CMIMEM_TRACEBACK", None)
  done = subprocess.run(
      [sys.executable, "-m", "cmimem_jax.train",
       "--config=configs/qwen3_4b_h20_vllm.py",
       f"--workdir={tmp_path / 'train'}",
       f"--config.policy.path={tmp_path}", f"--config.dataset.path={data}",
       f"--config.encoder.endpoint.base_url={url}",
       f"--config.rl.snapshots={tmp_path / 'states'}",
       f"--config.qa.answer.base_url={url}",
       f"--config.qa.judge_endpoint.base_url={url}"],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
      check=False)
  assert done.returncode == 2, done.stderr
  assert done.stderr.splitlines() == [f"error: {INSTALL_HINT}"]
  assert not (tmp_path / "train").exists()


def test_weights_for_vllm_match_the_transformers_state_dict(tmp_path):
  from cmimem_jax.testing.hf_models import hf_causal_lm
  reference, directory = hf_causal_lm(tmp_path, "qwen3",
                                      tie_word_embeddings=False)
  ours = dict(vllm_weights(load_hf(directory)))
  want = reference.state_dict()
  assert set(ours) == set(want)
  for name, tensor in want.items():
    np.testing.assert_allclose(ours[name].numpy(), tensor.numpy(), atol=1e-5,
                               err_msg=name)


def test_sample_output_packs_vllm_completions_like_the_sampler():
  logprob = types.SimpleNamespace
  completions = [
      types.SimpleNamespace(token_ids=[5, 6], logprobs=[
          {5: logprob(logprob=-0.5)}, {6: logprob(logprob=-1.5)}]),
      types.SimpleNamespace(token_ids=[7], logprobs=[{7: -0.25}])]
  out = sample_output([[1, 2, 3], [4]], completions, 4, pad_id=0)
  np.testing.assert_array_equal(out.tokens, [[5, 6, 0, 0], [7, 0, 0, 0]])
  np.testing.assert_allclose(out.logprobs[:, :2], [[-0.5, -1.5], [-0.25, 0]])
  np.testing.assert_array_equal(out.lengths, [2, 1])
  np.testing.assert_array_equal(out.prompt_mask, [[1, 1, 1], [0, 0, 1]])


def test_recomputed_logprobs_match_the_jax_sampler():
  model = Qwen3(preset("tiny", vocab_size=64), rngs=nnx.Rngs(0))
  sampler = Sampler(model, SamplingConfig(temperature=0.7, top_p=1.0,
                                          max_new_tokens=6), buckets=(8,))
  out = sampler([[3, 4, 5], [9, 8, 7, 6, 5]], jax.random.key(1))
  ours, gap = recompute_logprobs(model, out, temperature=0.7, chunk=4)
  assert gap < 1e-5
  np.testing.assert_allclose(ours, out.logprobs, atol=1e-5)


def test_generate_sends_per_row_settings_and_distinct_seeds(monkeypatch):
  """Each row gets its own SamplingParams: its temperature, top-p, budget
  and seed (one shared seed made a GRPO group's rollouts identical)."""
  calls = []

  class FakeLLM:
    def generate(self, requests, params, use_tqdm):
      calls.append((requests, params))
      return [types.SimpleNamespace(outputs=[types.SimpleNamespace(
          token_ids=[7] * p.max_tokens, logprobs=None)]) for p in params]

  fake_vllm = types.SimpleNamespace(
      SamplingParams=lambda **kw: types.SimpleNamespace(**kw),
      LLM=lambda **kw: FakeLLM())
  monkeypatch.setattr("cmimem_jax.sampling.vllm_engine.import_vllm",
                      lambda: fake_vllm)
  engine = VLLMEngine("/unused", eos_ids=(2,), pad_id=0)
  out = engine.generate([[1, 2], [3]], jax.random.key(0), [0.0, 0.8], 0.9, 4,
                        row_budgets=[4, 2])
  (requests, params), = calls
  assert requests == [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3]}]
  assert [(p.temperature, p.top_p, p.max_tokens) for p in params] == [
      (0.0, 0.9, 4), (0.8, 0.9, 2)]
  assert params[0].seed != params[1].seed
  np.testing.assert_array_equal(out.lengths, [4, 2])
