"""Per-token log-probs of a sequence under a Flax causal LM, chunked.

`[B, T, V]` logits for a 20k-token prompt and a 150k vocabulary would be
terabytes; instead the final hidden states are computed once and the LM
head + log-softmax run over sequence chunks of `chunk` positions under
`jax.checkpoint` (when there is more than one chunk), so at most
`[B, chunk, V]` logits exist at a time, in the forward and in the backward
pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from cmimem_jax.models.qwen3.model import Qwen3, positions_from_mask
from cmimem_jax.parallel.partition import constrain


def token_logprobs(model: Qwen3, tokens: jax.Array, mask: jax.Array, *,
                   temperature: float = 1.0, chunk: int = 256,
                   start: int = 1, mesh: Mesh | None = None
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

  Returns:
    `(logprobs [B, T], entropy [B, T])` float32; columns before `start`
    (and column 0, which has no context) are 0.
  """
  if temperature < 0:
    raise ValueError("temperature must be >= 0")
  if not 1 <= start < tokens.shape[1]:
    raise ValueError(f"start must be in [1, {tokens.shape[1]}), got {start}")
  scale = 1.0 / (temperature or 1.0)
  tokens = constrain(tokens, mesh, "tokens")
  hidden, _ = model.hidden_states(tokens, positions_from_mask(mask), mask)
  # Position t - 1 predicts token t, for t = start .. T-1.
  hidden = constrain(hidden, mesh, "hidden")[:, start - 1:-1]
  targets = tokens[:, start:]
  b, t = targets.shape
  chunk = max(1, min(chunk, t))
  pad = -t % chunk
  hidden = jnp.pad(hidden, [(0, 0), (0, pad), (0, 0)])
  targets = jnp.pad(targets, [(0, 0), (0, pad)])
  n = (t + pad) // chunk
  hidden = hidden.reshape(b, n, chunk, -1).swapaxes(0, 1)
  targets = targets.reshape(b, n, chunk).swapaxes(0, 1)

  def one_chunk(args):
    h, target = args
    logits = constrain(model.logits(h) * scale, mesh, "logits")
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, target[..., None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    return picked, entropy

  if n > 1:
    # Keep one chunk's logits alive at a time: the backward pass recomputes
    # them. With a single chunk that recomputation (an LM-head GEMM plus
    # the log-softmax: ~13 % of a SmolLM2 train step) saves no memory.
    one_chunk = jax.checkpoint(one_chunk)
  picked, entropy = jax.lax.map(one_chunk, (hidden, targets))
  unchunk = lambda x: x.swapaxes(0, 1).reshape(b, -1)[:, :t]  # noqa: E731
  zero = jnp.zeros((b, start), jnp.float32)
  return (jnp.concatenate([zero, unchunk(picked)], axis=1),
          jnp.concatenate([zero, unchunk(entropy)], axis=1))
