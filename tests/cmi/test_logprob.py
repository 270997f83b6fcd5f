"""App. E log-prob estimator: batched teacher-forced scores against a
direct per-sequence computation, and its plumbing into the reward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cmimem_jax.cmi import PolicyProfileLM, memory_text
from cmimem_jax.encoders import HashingEncoder
from cmimem_jax.memory import (Action, MemoryBank, MemoryType, Operation,
                               apply_operations, parse)
from cmimem_jax.models.qwen3 import Qwen3, preset
from cmimem_jax.rl import mean_continuation_logprobs
from cmimem_jax.sampling import ChatPolicy
from cmimem_jax.sampling.policy import load_tokenizer
from cmimem_jax.task.reward import RewardComputer, RewardConfig, RolloutInput

ENCODER = HashingEncoder(64)


def _direct(model, prompt, continuation):
  """Mean log-prob of `continuation` after `prompt`, no padding at all."""
  tokens = jnp.asarray([list(prompt) + list(continuation)])
  logits, _ = model(tokens, attention_mask=jnp.ones_like(tokens))
  logp = jax.nn.log_softmax(logits[0, :-1].astype(jnp.float32), axis=-1)
  picked = [float(logp[len(prompt) - 1 + i, t])
            for i, t in enumerate(continuation)]
  return float(np.mean(picked)) if picked else 0.0


def test_batched_continuation_logprobs_equal_direct_computation():
  model = Qwen3(preset("tiny", vocab_size=64), rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  prompts = [rng.integers(1, 64, n).tolist() for n in (5, 9, 2)]
  continuations = [rng.integers(1, 64, n).tolist() for n in (4, 1, 7)]
  got = mean_continuation_logprobs(model, prompts, continuations, chunk=3,
                                   multiple=8)
  want = [_direct(model, p, c) for p, c in zip(prompts, continuations)]
  np.testing.assert_allclose(got, want, atol=1e-5)
  assert mean_continuation_logprobs(model, [[1, 2]], [[]])[0] == 0.0
  with pytest.raises(ValueError, match="non-empty prompt"):
    mean_continuation_logprobs(model, [[]], [[3]])


@pytest.fixture(scope="module")
def policy_lm():
  tokenizer = load_tokenizer("")  # The embedded SmolLM2 tokenizer.
  model = Qwen3(preset("tiny", vocab_size=len(tokenizer)), rngs=nnx.Rngs(1))
  policy = ChatPolicy.jax(model, tokenizer, max_prompt_tokens=500,
                          buckets=(256, 500))
  return PolicyProfileLM(policy, lambda: model, max_new_tokens=6, chunk=64)


def _banks():
  before = MemoryBank("u", ENCODER.dim)
  before.core = "Name: Ana"
  after, _ = apply_operations(before, [
      Operation(MemoryType.CORE, Action.APPEND, ("Owns a beagle named Rex",)),
      Operation(MemoryType.EPISODIC, Action.ADD, ("2024-03-01: adopted Rex",))],
      ENCODER, session_index=0)
  return before, after


def test_profile_gain_is_the_difference_of_direct_scores(policy_lm):
  before, after = _banks()
  context = "user: I adopted a beagle named Rex"
  (gain,) = policy_lm.profile_gain(
      [[{"role": "user", "content": memory_text(before) + context}]],
      [[{"role": "user", "content": memory_text(after) + context}]])
  policy, model = policy_lm.policy, policy_lm.model()
  prompt_after = policy.encode([{"role": "user",
                                 "content": memory_text(after) + context}])
  prompt_before = policy.encode([{"role": "user",
                                  "content": memory_text(before) + context}])
  out = policy.generate([prompt_after], jax.random.key(0), 0.0, 1.0, 6)
  profile = policy.completion_tokens(out, 0)
  assert profile  # A random model rarely stops at once.
  want = (_direct(model, prompt_after, profile)
          - _direct(model, prompt_before, profile))
  assert gain == pytest.approx(want, abs=1e-5)
  assert "Owns a beagle named Rex" in memory_text(after)
  assert "Episodic memories:\n- 2024-03-01: adopted Rex" in memory_text(after)


def test_reward_gives_each_operation_its_rollouts_gain(policy_lm):
  before, after = _banks()
  text = ("CORE:APPEND|Owns a beagle named Rex\nEPISODIC:ADD|2024-03-01: "
          "adopted Rex\nSEMANTIC:SKIP\nPROCEDURAL:SKIP")
  config = RewardConfig(estimator="logprob", shaping="none",
                        semantic_skip_cosine=0.5, semantic_skip_coverage=0.5)
  computer = RewardComputer(ENCODER, config, policy_lm)
  rollout = RolloutInput(before, "user: I adopted Rex", parse(text), 0.5,
                         bank_after=after)
  (terms,) = computer([rollout])
  gains = {op.rho_new for op in terms.operations}
  assert len(gains) == 1 and len(terms.operations) == 2
  assert all(op.rho_old is None for op in terms.operations)
  gain = gains.pop()
  assert terms.cmi == pytest.approx(min(max(gain, 0.0), 1.0))
  with pytest.raises(ValueError, match="bank_after"):
    computer([RolloutInput(before, "x", parse(text), 0.5)])
  with pytest.raises(ValueError, match="reference LM"):
    RewardComputer(ENCODER, config)
