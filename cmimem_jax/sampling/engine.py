"""The one interface every generation engine implements.

The training loop, evaluation and the server generate through a
`ChatPolicy` (chat template in, text out), which drives an engine: the JAX
`Sampler` (default, any platform) or `VLLMEngine` (GPU fallback). An engine
takes token-id prompts and returns a `SampleOutput` in the sampler's layout
(left-padded prompts, right-padded completions, per-token log-probs), so
everything downstream — GRPO batches, decoding, the server — is the same
whichever engine produced it.

A training step (`rl.step.GRPOStep`) drives any engine through the hooks
below (`generate_waves`, `reports_learner_logprobs`, `release`,
`update_metrics`; `lower` where the engine's program is JAX's), never by
its type.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import jax

from cmimem_jax.models.qwen3.model import Qwen3
from cmimem_jax.sampling.sampler import SampleOutput


class GenerationEngine(Protocol):
  """Token ids in, sampled completions out."""

  def generate(self, prompts: Sequence[Sequence[int]], key: jax.Array,
               temperature: float | Sequence[float],
               top_p: float | Sequence[float], max_new_tokens: int,
               row_budgets: Sequence[int] | None = None,
               constrained: bool = True) -> SampleOutput:
    """Samples one completion per prompt (`temperature` 0: greedy).

    `temperature` / `top_p`: one value or one per row. `row_budgets`: each
    row's own token limit (<= `max_new_tokens`, the output width).
    `constrained=False`: free text even where the engine decodes under a
    grammar (the policy's Listing 5 / 8 / 9 calls are not DSL)."""
    ...

  def generate_waves(self, prompts: Sequence[Sequence[int]], key: jax.Array,
                     temperature: float | Sequence[float],
                     top_p: float | Sequence[float], max_new_tokens: int,
                     ahead: bool = True) -> Iterator[SampleOutput]:
    """`generate`'s output for the same arguments, one decoding wave (a
    run of consecutive rows) at a time, each as soon as it is decoded:
    a training step scores wave w while wave w + 1 decodes. `ahead`: the
    next wave may be decoding while the caller holds this one (False: it
    starts when the caller asks for it, so the caller's own use of the
    devices between waves never waits behind a wave). An engine that
    decodes all rows at once yields one wave."""
    ...

  def set_model(self, model: Qwen3) -> None:
    """Generates from `model`'s weights from now on (after an update)."""
    ...

  # Whether the log-probs `generate` reports are the learner's own (same
  # model, same math: the JAX sampler); if not (vLLM), a training step
  # recomputes them with the learner before its update.
  reports_learner_logprobs: bool

  def release(self, programs: bool = False, weights: bool = False) -> None:
    """Frees what the engine holds between calls before a learner update
    that needs the memory (KV buffers; with `programs` its compiled
    programs, with `weights` its own copy of the weights: `set_model`
    hands the new ones over). Nothing for an engine holding none."""
    ...

  def update_metrics(self) -> dict[str, Any]:
    """What the last `set_model` did, as step metrics (e.g. how vLLM got
    the weights); {} for nothing to report."""
    ...

  def lower(self, rows: int, length: int, max_new_tokens: int,
            group: int = 1, constrained: bool = True) -> Any:
    """The `jax.stages.Lowered` generation program of one wave of `rows`
    rows (`group` per shared prompt) in prompt bucket `length`: what
    `tools/plan.py` compiles ahead of time. Engines whose program is not
    JAX's raise NotImplementedError."""
    ...


class EngineHooks:
  """The training-step hooks of `GenerationEngine` for an engine that
  decodes a call in one wave, has nothing to free or report, and whose
  log-probs are the learner's (a base for stand-in engines and
  `VLLMEngine`, which overrides what differs; `Sampler` defines its
  own)."""

  reports_learner_logprobs = True

  def generate_waves(self, prompts: Sequence[Sequence[int]], key: jax.Array,
                     temperature: float | Sequence[float],
                     top_p: float | Sequence[float], max_new_tokens: int,
                     ahead: bool = True) -> Iterator[SampleOutput]:
    """One wave: the whole `generate` call."""
    del ahead
    yield self.generate(prompts, key, temperature, top_p, max_new_tokens)

  def release(self, programs: bool = False, weights: bool = False) -> None:
    del programs, weights

  def update_metrics(self) -> dict[str, Any]:
    return {}

  def lower(self, rows: int, length: int, max_new_tokens: int,
            group: int = 1, constrained: bool = True) -> Any:
    raise NotImplementedError(f"{type(self).__name__} has no JAX program")
