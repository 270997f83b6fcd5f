"""Rollouts through vLLM (SPEC §7, the paper's H20 setup): GPU only.

`VLLMEngine` is a `GenerationEngine`: it returns a `SampleOutput` like the
JAX sampler, so a `ChatPolicy` drives either (`rollout.engine = "vllm"`).
Generation starts from our token ids with the same temperature / top-p /
length; after every update the policy's weights go to vLLM as HF-named
tensors (`set_model` -> `push_weights`: in-process `load_weights`, or a
saved HF checkpoint a separate server reloads). vLLM's log-probs are kept
only to measure the sampler/trainer gap: the learner recomputes the old
log-probs in JAX (`rl.recompute_logprobs`).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np

from cmimem_jax import storage
from cmimem_jax.caches import cache_dir
from cmimem_jax.config import MissingDependency
from cmimem_jax.models.qwen3.model import Qwen3
from cmimem_jax.models.qwen3.params import hf_tensors, save_hf
from cmimem_jax.sampling.engine import EngineHooks
from cmimem_jax.sampling.sampler import SampleOutput, bucket_length, left_pad

INSTALL_HINT = ("rollout.engine='vllm' needs vLLM, which is not installed "
                "(rollout.engine='jax' runs without it); on a CUDA machine: "
                "pip install vllm")


def import_vllm() -> Any:
  """The `vllm` module; `MissingDependency` (one line ending with the
  install command) where it is not installed."""
  try:
    import vllm
  except ImportError as e:
    raise MissingDependency(INSTALL_HINT) from e
  return vllm


def vllm_weights(model: Qwen3) -> Iterator[tuple[str, Any]]:
  """HF-named torch tensors converted from the NNX policy (what vLLM's
  `load_weights` consumes)."""
  import torch
  for name, array in hf_tensors(model):
    yield name, torch.from_numpy(array)


class VLLMEngine(EngineHooks):
  """An in-process `vllm.LLM` over an HF checkpoint of the policy. Its
  rollouts come in one wave (`EngineHooks.generate_waves`: vLLM schedules
  its own batches, and `generate` returns when all are done).

  Args:
    checkpoint: HF directory vLLM starts from (`save_hf` of the policy).
    eos_ids / pad_id: as the JAX sampler's.
    **llm_kwargs: passed to `vllm.LLM` (tensor_parallel_size,
      gpu_memory_utilization, max_model_len, dtype, ...).
  """

  def __init__(self, checkpoint: str, eos_ids: Sequence[int] = (),
               pad_id: int = 0, buckets: Sequence[int] = (), **llm_kwargs):
    vllm = import_vllm()
    self._vllm = vllm
    self.checkpoint, self.eos_ids, self.pad_id = checkpoint, tuple(eos_ids), pad_id
    self.buckets = tuple(buckets)
    self.llm = vllm.LLM(model=checkpoint, skip_tokenizer_init=True,
                        **llm_kwargs)
    self.last_push: str | None = None  # How the last weights got there.

  def set_model(self, model: Qwen3) -> None:
    """`GenerationEngine.set_model`: pushes the weights to vLLM."""
    self.last_push = self.push_weights(model)

  # vLLM's log-probs are its kernels' (bf16 paths, other reductions), not
  # the learner's: a training step recomputes them in JAX and logs the gap.
  reports_learner_logprobs = False

  def release(self, programs: bool = False, weights: bool = False) -> None:
    """`GenerationEngine.release`: vLLM's memory is its own (sized by
    `gpu_memory_utilization` when it starts); nothing to free."""
    del programs, weights

  def update_metrics(self) -> dict[str, Any]:
    """`GenerationEngine.update_metrics`: how the last weights got to vLLM
    (`vllm_weight_push`: "load_weights" or "reload")."""
    return {"vllm_weight_push": self.last_push}

  def lower(self, rows: int, length: int, max_new_tokens: int,
            group: int = 1, constrained: bool = True) -> Any:
    """`GenerationEngine.lower`: vLLM's programs are not JAX's."""
    raise NotImplementedError("vLLM compiles its own CUDA graphs; "
                              "tools/plan.py prices the JAX sampler's "
                              "program instead")

  def push_weights(self, model: Qwen3) -> str:
    """Sends the current policy to vLLM; returns how ("load_weights" or
    "reload")."""
    executor = getattr(self.llm.llm_engine, "model_executor", None)
    worker = getattr(executor, "driver_worker", None)
    runner = getattr(getattr(worker, "worker", worker), "model_runner", None)
    if runner is not None and hasattr(runner.model, "load_weights"):
      runner.model.load_weights(vllm_weights(model))
      return "load_weights"
    # Multi-process executors: write the checkpoint and let vLLM reload it.
    save_hf(model, self.checkpoint)
    self.llm.collective_rpc("reload_weights")
    return "reload"

  def generate(self, prompts: Sequence[list[int]], key: jax.Array,
               temperature: float | Sequence[float],
               top_p: float | Sequence[float], max_new_tokens: int,
               row_budgets: Sequence[int] | None = None,
               constrained: bool = True) -> SampleOutput:
    del constrained  # vLLM rollouts are never grammar-constrained here.
    seed = int(jax.random.randint(key, (), 0, 2 ** 31 - 1))
    rows = len(prompts)
    temperature, top_p = (np.broadcast_to(np.asarray(v, float), (rows,))
                          for v in (temperature, top_p))
    budgets = np.broadcast_to(np.asarray(
        max_new_tokens if row_budgets is None else row_budgets), (rows,))
    # One SamplingParams per row (vLLM takes a list): per-row settings, and
    # distinct seeds so equal prompts do not draw equal samples.
    params = [self._vllm.SamplingParams(
        temperature=float(temperature[row]), top_p=float(top_p[row]),
        max_tokens=int(budgets[row]), stop_token_ids=list(self.eos_ids),
        logprobs=0, seed=seed + row) for row in range(rows)]
    requests = [{"prompt_token_ids": list(p)} for p in prompts]
    results = self.llm.generate(requests, params, use_tqdm=False)
    return sample_output(prompts, [r.outputs[0] for r in results],
                         max_new_tokens, self.pad_id, self.buckets)


def sample_output(prompts: Sequence[list[int]], completions: Sequence[Any],
                  max_new_tokens: int, pad_id: int,
                  buckets: Sequence[int] = ()) -> SampleOutput:
  """Packs vLLM `CompletionOutput`s (token_ids, logprobs) like the JAX
  sampler's output (left-padded prompt layout, right-padded tokens)."""
  longest = max(len(p) for p in prompts)
  length = bucket_length(longest, buckets) if buckets else longest
  prompt_tokens, prompt_mask = left_pad(prompts, length, pad_id)
  tokens = np.full((len(prompts), max_new_tokens), pad_id, np.int32)
  logprobs = np.zeros((len(prompts), max_new_tokens), np.float32)
  lengths = np.zeros(len(prompts), np.int32)
  for row, out in enumerate(completions):
    ids = list(out.token_ids)[:max_new_tokens]
    tokens[row, :len(ids)] = ids
    lengths[row] = len(ids)
    for i, (token, entry) in enumerate(zip(ids, out.logprobs or [])):
      value = entry[token]
      logprobs[row, i] = getattr(value, "logprob", value)
  return SampleOutput(tokens, logprobs, lengths, prompt_tokens, prompt_mask)


def checkpoint_dir(workdir: str) -> str:
  """Where the trainer hands vLLM its weights: `workdir/vllm_policy`; for a
  workdir on object storage (vLLM reads local files) a local scratch
  folder named after it, under `caches.cache_dir()`."""
  if storage.is_remote(workdir):
    digest = hashlib.sha256(workdir.encode()).hexdigest()[:16]
    return os.path.join(cache_dir(), "vllm_policy", digest)
  return os.path.join(workdir, "vllm_policy")
