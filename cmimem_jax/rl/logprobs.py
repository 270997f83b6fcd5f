"""Per-token log-probs of a sequence under a Flax causal LM, chunked.

`[B, T, V]` logits for a 20k-token prompt and a 150k vocabulary would be
terabytes; instead the final hidden states are computed once and the LM
head + log-softmax run over sequence chunks of `chunk` positions under
`jax.checkpoint` (when there is more than one chunk), so at most
`[B, chunk, V]` logits exist at a time, in the forward and in the backward
pass.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from cmimem_jax.models.qwen3.model import Qwen3, positions_from_mask
from cmimem_jax.parallel.partition import constrain
from cmimem_jax.sampling.constraint import constrain_logits
from cmimem_jax.sampling.sampler import SampleOutput

# `(min_budget [S, V], states [B, T], budgets [B, T], eos_id)`: the
# sampler's constraint seen by the learner (`TokenConstraint`); a state of
# -1 leaves that position unconstrained.
Constraint = tuple[jax.Array, jax.Array, jax.Array, int]


def token_logprobs(model: Qwen3, tokens: jax.Array, mask: jax.Array, *,
                   temperature: float = 1.0, chunk: int = 256,
                   start: int = 1, mesh: Mesh | None = None,
                   constraint: Constraint | None = None, group: int = 1
                   ) -> tuple[jax.Array, jax.Array]:
  """Log-prob and entropy of each token given the tokens before it.

  Args:
    model: the policy.
    tokens: `[B, T]` prompt + completion ids (prompt left-padded).
    mask: `[B, T]` 1 for real tokens; RoPE positions come from it.
    temperature: logits are divided by it, as in the sampler (0 -> 1:
      greedy samplers record log-probs at temperature 1).
    chunk: sequence positions per LM-head chunk.
    start: first position whose log-prob is wanted (the completion's start:
      the LM head never runs over the prompt).
    mesh: when given, activations are constrained to the mesh's rules.
    constraint: grammar-constrained decoding's mask (`Constraint`): the
      log-probs and entropy are then under the masked distribution, as the
      constrained sampler records them.
    group: rows per shared prompt: when > 1, every run of `group`
      consecutive rows has the same `tokens` / `mask` before `start` (the
      G rollouts of one prompt, the caller's promise), and the prompt
      runs through the model once per group
      (`Qwen3.shared_prompt_hidden_states`; same numbers, less work).

  Returns:
    `(logprobs [B, T], entropy [B, T])` float32; columns before `start`
    (and column 0, which has no context) are 0.
  """
  if temperature < 0:
    raise ValueError("temperature must be >= 0")
  if not 1 <= start < tokens.shape[1]:
    raise ValueError(f"start must be in [1, {tokens.shape[1]}), got {start}")
  scale = 1.0 / (temperature or 1.0)
  if group < 1 or tokens.shape[0] % group:
    raise ValueError(f"{tokens.shape[0]} rows do not form groups of {group}")
  tokens = constrain(tokens, mesh, "tokens")
  positions = positions_from_mask(mask)
  # Position t - 1 predicts token t, for t = start .. T-1.
  if group == 1:
    hidden, _ = model.hidden_states(tokens, positions, mask)
    hidden = constrain(hidden, mesh, "hidden")[:, start - 1:-1]
  else:
    first_of_group = lambda x: x[::group, :start]  # noqa: E731
    prompt_hidden, hidden = model.shared_prompt_hidden_states(
        first_of_group(tokens), first_of_group(mask), tokens[:, start:],
        positions[:, start:], mask[:, start:])
    last_prompt = jnp.repeat(prompt_hidden[:, -1:], group, axis=0)
    hidden = jnp.concatenate([last_prompt, hidden[:, :-1]], axis=1)
    hidden = constrain(hidden, mesh, "hidden")
  targets = tokens[:, start:]
  b, t = targets.shape
  chunk = max(1, min(chunk, t))
  pad = -t % chunk
  n = (t + pad) // chunk

  def chunked(x: jax.Array) -> jax.Array:
    """`[B, t, ...]` -> `[n, B, chunk, ...]`."""
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    return x.reshape(b, n, chunk, *x.shape[2:]).swapaxes(0, 1)

  # Without a constraint every position is unconstrained (state -1).
  states = budgets = jnp.full((b, t), -1, jnp.int32)
  if constraint is not None:
    min_budget, states, budgets, eos_id = constraint
    min_budget = jnp.asarray(min_budget)
    states, budgets = states[:, start:], budgets[:, start:]

  def one_chunk(args):
    h, target, state, budget = args
    # The vocabulary-parallel head: rows gathered, the vocabulary split.
    logits = model.logits(constrain(h, mesh, "head_hidden")) * scale
    if constraint is not None:
      # An unconstrained position (-1) allows every token.
      rows = jnp.where(state[..., None] >= 0,
                       min_budget[jnp.maximum(state, 0)],
                       jnp.iinfo(min_budget.dtype).min)
      logits = constrain_logits(logits, rows, budget, eos_id)
    logits = constrain(logits, mesh, "logits")
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, target[..., None], axis=-1)[..., 0]
    # `where`: masked tokens have p = 0 and logp = -inf.
    entropy = -jnp.sum(jnp.where(logp > -jnp.inf, jnp.exp(logp) * logp, 0.0),
                       axis=-1)
    return picked, entropy

  if n > 1:
    # Keep one chunk's logits alive at a time: the backward pass recomputes
    # them. With a single chunk that recomputation (an LM-head GEMM plus
    # the log-softmax: ~13 % of a SmolLM2 train step) saves no memory.
    one_chunk = jax.checkpoint(one_chunk)
  picked, entropy = jax.lax.map(one_chunk, (
      chunked(hidden), chunked(targets), chunked(states), chunked(budgets)))
  unchunk = lambda x: x.swapaxes(0, 1).reshape(b, -1)[:, :t]  # noqa: E731
  zero = jnp.zeros((b, start), jnp.float32)
  return (jnp.concatenate([zero, unchunk(picked)], axis=1),
          jnp.concatenate([zero, unchunk(entropy)], axis=1))


@functools.partial(nnx.jit, static_argnames=("temperature", "chunk", "start"),
                   graph=False)
def _policy_logprobs(model: Qwen3, tokens: jax.Array, mask: jax.Array,
                     temperature: float, chunk: int, start: int) -> jax.Array:
  return token_logprobs(model, tokens, mask, temperature=temperature,
                        chunk=chunk, start=start)[0]


def recompute_logprobs(model: Qwen3, out: SampleOutput, temperature: float,
                       chunk: int = 256) -> tuple[np.ndarray, float]:
  """Old log-probs of `out`'s completions under the JAX policy (rollouts
  from an engine whose log-probs the learner does not trust, e.g. vLLM),
  and the mean |engine − JAX| gap over completion tokens (logged).

  Returns:
    `([B, R] float32 log-probs, 0 past each row's end), gap`.
  """
  prompt = out.prompt_tokens.shape[1]
  tokens = np.concatenate([out.prompt_tokens, out.tokens], 1)
  completion = (np.arange(out.tokens.shape[1])[None]
                < out.lengths[:, None]).astype(np.int32)
  mask = np.concatenate([out.prompt_mask, completion], 1)
  logprobs = _policy_logprobs(model, tokens, mask, temperature, chunk, prompt)
  ours = np.asarray(logprobs)[:, prompt:] * completion
  gap = float(np.abs(ours - out.logprobs * completion).sum()
              / max(completion.sum(), 1))
  return ours.astype(np.float32), gap


def mean_continuation_logprobs(model: Qwen3, prompts: Sequence[Sequence[int]],
                               continuations: Sequence[Sequence[int]],
                               pad_id: int = 0, chunk: int = 256,
                               multiple: int = 64) -> np.ndarray:
  """Mean per-token log-prob of each continuation given its prompt (teacher
  forcing, temperature 1), in one jitted call.

  Prompts are left-padded and continuations right-padded to multiples of
  `multiple`, rows to a power of two, so few shapes compile.

  Returns:
    `[B]` float32; 0 for an empty continuation.
  """
  if len(prompts) != len(continuations):
    raise ValueError(f"{len(prompts)} prompts for {len(continuations)} "
                     "continuations")
  if not prompts or not all(prompts):
    raise ValueError("every continuation needs a non-empty prompt")
  round_up = lambda n: -(-max(n, 1) // multiple) * multiple  # noqa: E731
  width_p = round_up(max(len(p) for p in prompts))
  width_c = round_up(max(len(c) for c in continuations))
  rows = 1 << (len(prompts) - 1).bit_length()
  tokens = np.full((rows, width_p + width_c), pad_id, np.int32)
  mask = np.zeros_like(tokens)
  mask[len(prompts):, width_p - 1] = 1  # Padding rows: one real token.
  for i, (prompt, continuation) in enumerate(zip(prompts, continuations)):
    tokens[i, width_p - len(prompt):width_p] = prompt
    tokens[i, width_p:width_p + len(continuation)] = continuation
    mask[i, width_p - len(prompt):width_p + len(continuation)] = 1
  logprobs = np.asarray(_policy_logprobs(model, tokens, mask, 1.0, chunk,
                                         width_p))[:len(prompts), width_p:]
  lengths = np.array([len(c) for c in continuations], np.float32)
  continuation = mask[:len(prompts), width_p:]
  return ((logprobs * continuation).sum(1) / np.maximum(lengths, 1)
          ).astype(np.float32)
