"""Grammar-constrained DSL decoding: every sample parses as a valid
response, the learner's constrained log-probs equal the sampler's, and
the token budget bounds lengths."""

import re

import jax
import numpy as np
import pytest
from flax import nnx

from cmimem_jax.memory.dsl import parse, response_regex
from cmimem_jax.models.qwen3 import Qwen3, load_gguf_tokenizer, preset
from cmimem_jax.models.qwen3.params import smollm2_gguf_path
from cmimem_jax.parallel import make_mesh
from cmimem_jax.rl import (GRPOLossConfig, Learner, OptimizerConfig,
                           TrainStepConfig, rollout_batch, token_logprobs)
from cmimem_jax.sampling import ChatPolicy, Sampler, SamplingConfig
from cmimem_jax.sampling.constraint import TokenConstraint


@pytest.fixture(scope="module")
def tokenizer():
  return load_gguf_tokenizer(smollm2_gguf_path())


@pytest.fixture(scope="module")
def constraint(tokenizer):
  return TokenConstraint.from_regex(response_regex(), tokenizer)


@pytest.fixture(scope="module")
def model(tokenizer):
  # Random weights over the real vocabulary: the automaton must do all the
  # work of producing valid DSL.
  return Qwen3(preset("tiny", vocab_size=len(tokenizer)), rngs=nnx.Rngs(0))


def test_a_compiled_constraint_is_kept_on_disk_and_loaded(tokenizer,
                                                          tmp_path,
                                                          monkeypatch):
  """A later call (in any process sharing the cache directory) loads the
  tables instead of compiling the regex; a damaged file is compiled
  again."""
  monkeypatch.setenv("CMIMEM_CACHE_DIR", str(tmp_path))
  compiled = []
  compile_regex = TokenConstraint._compile.__func__

  def recording(cls, regex, tok):
    compiled.append(regex)
    return compile_regex(cls, regex, tok)

  monkeypatch.setattr(TokenConstraint, "_compile", classmethod(recording))
  regex = "(yes|no)"
  first = TokenConstraint.from_regex(regex, tokenizer)
  (saved,) = (tmp_path / "constraints").glob("*.npz")
  loaded = TokenConstraint.from_regex(regex, tokenizer)
  assert compiled == [regex]
  saved.write_bytes(b"damaged")
  recompiled = TokenConstraint.from_regex(regex, tokenizer)
  assert compiled == [regex, regex]
  for other in (loaded, recompiled):
    np.testing.assert_array_equal(other.next_state, first.next_state)
    np.testing.assert_array_equal(other.min_budget, first.min_budget)
    assert (other.initial_state, other.eos_id) == (first.initial_state,
                                                   first.eos_id)
  # Another regex over the same vocabulary is another entry.
  TokenConstraint.from_regex("(maybe)", tokenizer)
  assert compiled == [regex, regex, "(maybe)"]


def sampler(model, tokenizer, constraint):
  eos = tokenizer.eos_token_id
  return Sampler(model, SamplingConfig(eos_ids=(eos,), pad_id=eos),
                 buckets=(16,), constraint=constraint)


def test_regex_accepts_valid_and_rejects_invalid_responses():
  regex = re.compile(response_regex())
  valid = ["CORE:APPEND|Works as a nurse\nEPISODIC:ADD|2023-05-08: met Ann\n"
           "EPISODIC:MERGE|a|b|a then b\nSEMANTIC:UPDATE|old|new\n"
           "PROCEDURAL:SKIP\n",
           "CORE:REPLACE|x|y\nEPISODIC:SKIP\nSEMANTIC:SKIP\n"
           "PROCEDURAL:ADD|How to: 1. step\n"]
  for text in valid:
    assert regex.fullmatch(text) and parse(text).valid
  invalid = ["CORE:SKIP\nEPISODIC:SKIP\nSEMANTIC:SKIP\nPROCEDURAL:SKIP\n",
             "CORE:APPEND| \nEPISODIC:SKIP\nSEMANTIC:SKIP\nPROCEDURAL:SKIP\n",
             "CORE:APPEND|a\nEPISODIC:SKIP\nEPISODIC:ADD|b\nSEMANTIC:SKIP\n"
             "PROCEDURAL:SKIP\n",
             "CORE:APPEND|a\nEPISODIC:MERGE|a|b\nSEMANTIC:SKIP\n"
             "PROCEDURAL:SKIP\n",
             "CORE:APPEND|a|b\nEPISODIC:SKIP\nSEMANTIC:SKIP\nPROCEDURAL:SKIP\n"]
  for text in invalid:
    assert not regex.fullmatch(text) and not parse(text).valid, text


# 4 x 50 = 200 samples; top-p (a full-vocabulary sort per step) once.
@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (0.7, 0.9),
                                               (1.0, 1.0), (1.5, 1.0)])
def test_every_constrained_sample_parses_as_valid_dsl(model, tokenizer,
                                                      constraint, temperature,
                                                      top_p):
  policy = ChatPolicy(sampler(model, tokenizer, constraint), tokenizer, 16)
  prompts = [[5 + i, 9, 13] for i in range(50)]
  out = policy.generate(prompts, jax.random.key(int(temperature * 10)),
                        temperature, top_p, 48)
  texts = [policy.decode(policy.completion_tokens(out, i))
           for i in range(len(prompts))]
  bad = [t for t in texts if not parse(t).valid]
  assert not bad, bad[:3]
  # The budget ends every row with EOS within max_new_tokens.
  assert all(out.tokens[i, out.lengths[i] - 1] == tokenizer.eos_token_id
             for i in range(len(prompts)))
  if temperature:
    assert len(set(texts)) > 10  # The constraint leaves room to sample.


def test_learner_logprobs_equal_the_constrained_samplers(model, tokenizer,
                                                         constraint):
  out = sampler(model, tokenizer, constraint)(
      [[3, 4, 5], [7, 8], [11]], jax.random.key(1), SamplingConfig(
          temperature=0.8, top_p=0.9, max_new_tokens=40,
          eos_ids=(tokenizer.eos_token_id,), pad_id=tokenizer.eos_token_id))
  batch = rollout_batch(out, np.zeros(3), constraint=constraint)
  prompt = out.prompt_tokens.shape[1]
  min_budget = constraint.padded_table("min_budget", model.config.vocab_size)
  ours, _ = token_logprobs(
      model, batch["tokens"], batch["mask"], temperature=0.8, chunk=16,
      start=prompt, constraint=(min_budget, batch["constraint_states"],
                                batch["constraint_budgets"],
                                tokenizer.eos_token_id))
  completion = batch["loss_mask"][:, prompt:] > 0
  np.testing.assert_allclose(np.asarray(ours)[:, prompt:][completion],
                             out.logprobs[completion], atol=1e-5)
  # Unconstrained log-probs differ: the mask is what makes them agree.
  plain, _ = token_logprobs(model, batch["tokens"], batch["mask"],
                            temperature=0.8, start=prompt)
  assert np.abs(np.asarray(plain)[:, prompt:][completion]
                - out.logprobs[completion]).max() > 1.0

  # The constrained learner's first step sees its own sampler's log-probs.
  learner = Learner(model, TrainStepConfig(
      loss=GRPOLossConfig(kl_beta=0.02),
      optimizer=OptimizerConfig(learning_rate=1e-4), temperature=0.8,
      logprob_chunk=16, constraint_eos_id=tokenizer.eos_token_id),
                    make_mesh("data:1", devices=jax.devices()[:1]),
                    min_budget=min_budget)
  batch["advantages"] = np.array([1.0, -1.0, 0.5], np.float32)
  metrics = learner.step(batch)
  assert metrics["logprob_gap"] < 1e-5
  assert np.isfinite(metrics["loss"]) and np.isfinite(metrics["entropy"])


def test_states_and_budget_errors(model, tokenizer, constraint):
  tokens = np.array([[tokenizer.encode("hello")[0]]], np.int32)
  with pytest.raises(ValueError, match="outside the constraint"):
    constraint.states(tokens, np.array([1]))
  with pytest.raises(ValueError, match="shortest completion"):
    sampler(model, tokenizer, constraint)([[1, 2]], jax.random.key(0),
                                          SamplingConfig(
                                              max_new_tokens=4,
                                              eos_ids=(2,), pad_id=2))
  with pytest.raises(ValueError, match="first EOS id"):
    Sampler(model, SamplingConfig(eos_ids=(7,)), constraint=constraint)


def test_free_text_calls_leave_the_grammar_and_take_their_budget(
    tokenizer, constraint):
  """The policy's editor calls (Listing 5 / 9) through the real sampler:
  not bound by the DSL grammar, and as long as their budget (not the
  policy's 256-token chat default)."""
  # Its own weights: the module's model was donated to a learner above.
  model = Qwen3(preset("tiny", vocab_size=len(tokenizer)), rngs=nnx.Rngs(3))
  policy = ChatPolicy.jax(model, tokenizer, max_prompt_tokens=60,
                          buckets=(64,), constraint=constraint)
  messages = [[{"role": "user", "content": "Compress: Ana, nurse, Oslo"}]]
  outputs = []
  generate = policy.engine.generate
  policy.engine.generate = lambda *args, **kwargs: (  # noqa: E731
      outputs.append(generate(*args, **kwargs)) or outputs[-1])
  (dsl,) = policy.chat_many(messages, max_tokens=80)
  assert parse(dsl.text).valid
  (free,) = policy.free_text().chat_many(messages, max_tokens=400)
  # A random model over 49k tokens almost never stops early.
  assert outputs[-1].tokens.shape[1] == 400 and outputs[-1].lengths[0] > 300
  assert not parse(free.text).valid


def test_sampler_and_learner_share_one_device_copy_of_the_tables(
    tokenizer, constraint):
  """The decode loop and the learner index the same `[S, V]` tables: one
  device copy of each (int16: 40 MB each for the DSL over SmolLM2's
  vocabulary), not one per user."""
  # Its own model: a learner takes over (donates) its weights.
  model = Qwen3(preset("tiny", vocab_size=len(tokenizer)), rngs=nnx.Rngs(0))
  assert constraint.next_state.dtype == np.int16
  mesh = make_mesh("data:1", devices=jax.devices()[:1])
  placed = constraint.device_tables(
      model.config.vocab_size, jax.sharding.NamedSharding(
          mesh, jax.sharding.PartitionSpec()))
  eos = tokenizer.eos_token_id
  engine = Sampler(model, SamplingConfig(eos_ids=(eos,), pad_id=eos),
                   buckets=(16,), constraint=constraint, mesh=mesh)
  learner = Learner(model, TrainStepConfig(
      loss=GRPOLossConfig(), constraint_eos_id=eos), mesh,
                    min_budget=placed[1])
  assert engine._constraint_arrays[:2] == placed
  assert learner.min_budget is placed[1]
