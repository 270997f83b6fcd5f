"""One prompt path: for the same session and bank, training (the trainer's
`rollout_prompter`, what every rollout, validation and snapshot prompt
is) and evaluation (the `policy` method's builder, `policy_responder`)
give the policy byte-identical prompts, a session whose prompt must be
trimmed to the policy's budget included."""

import datetime as dt
import json

import numpy as np
import pytest

from cmimem_jax.client import CallResult
from cmimem_jax.data import Session, Turn
from cmimem_jax.evaluation.builders import policy_responder
from cmimem_jax.memory import (Action, MemoryBank, MemoryType, Operation,
                               PolicyPrompter, apply_operations)
from cmimem_jax.sampling import encode_chat, load_tokenizer
from cmimem_jax.sampling.policy import ChatPolicy
from cmimem_jax.sampling.sampler import SampleOutput
from cmimem_jax.task.loop import RolloutConfig, rollout_prompter
from configs import eval_cpu, tiny

RESPONSE = "CORE:APPEND|Owns Rex\nEPISODIC:SKIP\nSEMANTIC:SKIP\nPROCEDURAL:SKIP"


class RecordingPolicy(ChatPolicy):
  """A `ChatPolicy` that keeps the messages evaluation sends it and the
  prompt ids it decodes from, and answers RESPONSE."""

  def __init__(self, tokenizer, max_prompt_tokens):
    super().__init__(None, tokenizer, max_prompt_tokens)
    self.sent, self.prompt_ids = [], []
    self.response = tokenizer.encode(RESPONSE, add_special_tokens=False)

  def chat_many(self, conversations, max_tokens=None, constrained=True):
    self.sent += list(conversations)
    return super().chat_many(conversations, max_tokens, constrained)

  def generate(self, prompts, *args, **kwargs):
    del args, kwargs
    self.prompt_ids += [list(p) for p in prompts]
    tokens = np.array([self.response] * len(prompts), np.int32)
    return SampleOutput(tokens, np.zeros(tokens.shape, np.float32),
                        np.full(len(prompts), tokens.shape[1]),
                        np.zeros((len(prompts), 1), np.int32),
                        np.ones((len(prompts), 1), bool))


class Endpoint:
  """A chat model without a known prompt budget (as `OpenAIClient`)."""

  def __init__(self):
    self.sent = []

  def chat_many(self, conversations, max_tokens=None):
    del max_tokens
    self.sent += list(conversations)
    return [CallResult(RESPONSE) for _ in conversations]


def _session(index, turns):
  return Session(f"s{index}", index, dt.datetime(2023, 5, 8 + index, 9, 30),
                 "", tuple(Turn(f"t{index}.{i}", speaker, speaker, text)
                           for i, (speaker, text) in enumerate(turns)))


SHORT = _session(3, [("user", "I adopted a beagle named Rex."),
                     ("assistant", "Congratulations on Rex!")])
# Long enough that its prompt only fits with fewer retrieved entries.
LONG = _session(4, [(("user", "assistant")[i % 2],
                     f"Rex and I walked trail number {i} past the lake and "
                     f"the old mill, then stopped at cafe {i} for tea.")
                    for i in range(24)])


@pytest.fixture
def bank(encoder):
  bank = MemoryBank("u", encoder.dim)
  bank, _ = apply_operations(bank, [
      Operation(MemoryType.CORE, Action.APPEND, ("Name: Ana; owns Rex",))] + [
      Operation(memory_type, Action.ADD,
                (f"{memory_type.value} note {i}: Rex walk {i} at the lake",))
      for memory_type in (MemoryType.EPISODIC, MemoryType.SEMANTIC,
                          MemoryType.PROCEDURAL) for i in range(25)],
      encoder, session_index=0)
  return bank


def test_training_and_evaluation_give_byte_identical_prompts(bank, encoder):
  training, evaluation = tiny.get_config(), eval_cpu.get_config()
  top_k = training.rollout.retrieval_top_k
  assert evaluation.memory.build_top_k == top_k
  tokenizer = load_tokenizer("")  # The embedded SmolLM2 tokenizer.
  length = lambda messages: len(encode_chat(tokenizer, messages))  # noqa: E731
  # The budget the short session's full prompt just fits.
  budget = length(PolicyPrompter(encoder, top_k)(bank, SHORT))
  full_long, _ = PolicyPrompter(encoder, top_k).fitted(bank, LONG)
  assert length(full_long) > budget  # The long session must be trimmed.
  policy = RecordingPolicy(tokenizer, budget)
  prompter = rollout_prompter(RolloutConfig.from_config(training.rollout),
                              encoder, policy)
  respond = policy_responder(policy, encoder, evaluation.memory.build_top_k)
  empty = MemoryBank("u", encoder.dim)
  for session_bank, session in ((empty, SHORT), (bank, SHORT), (bank, LONG)):
    trained = prompter(session_bank, session)
    assert respond(session_bank, session).valid
    evaluated = policy.sent[-1]
    assert json.dumps(evaluated).encode() == json.dumps(trained).encode()
    assert policy.prompt_ids[-1] == policy.encode(trained)  # Rollout ids.
  _, shown = prompter.fitted(bank, LONG)
  assert 0 < shown < top_k and length(trained) <= budget
  assert prompter.fitted(bank, SHORT)[1] == top_k
  # An endpoint's budget is its server's: the prompt goes whole.
  endpoint = Endpoint()
  policy_responder(endpoint, encoder, top_k)(bank, LONG)
  assert endpoint.sent == [full_long]
