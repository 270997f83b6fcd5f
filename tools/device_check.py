"""The accelerator check: what to run, once, on a lent GPU or TPU (under 8
minutes), one JSON line per check.

  python -m tools.device_check            # on the accelerator machine
  python -m tools.device_check --small    # small shapes (the CPU test)

Checks, each against a peer on the same device:
  attention    the accelerator attention backend (cuDNN on GPU, Pallas
               splash on TPU) against the XLA path, forward and gradients,
               bf16 inputs, packed rows;
  sampler      our KV-cache sampler's greedy tokens/s against
               `transformers.generate` (torch on the same device), same
               random weights;
  grpo_step    one whole GRPO step of the object `train` runs
               (`task.loop.grpo_step`: rollouts decoding on the mesh, the
               learner's update) on a Qwen3-0.6B-shape model with random
               weights (bf16 compute, full remat): rollout and update
               times, tokens/s and the device's peak memory;
  cmi_kernel   `residual_cmi` against the same math batched in torch on the
               device (B = 8192, N = 20, d = 1024), agreement and times;
  vllm         the vLLM engine end to end (generate from token ids, a
               weight push) when vLLM imports.
A check that cannot run here prints `{"check": ..., "skipped": reason}`;
one that fails prints its error and the script goes on. On a CPU only the
CPU-capable checks run (`--small` shapes in the test suite).
"""

from __future__ import annotations

import json
import tempfile
import time
import traceback
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from cmimem_jax.config import run_command


def best_time(fn: Callable[[], object], reps: int = 3) -> float:
  """Best wall time of `reps` runs after one warm-up run."""
  jax.block_until_ready(fn())
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return min(times)


def _torch_device() -> str | None:
  """The torch device matching JAX's backend, or None without torch."""
  try:
    import torch
  except ImportError:
    return None
  if jax.default_backend() == "gpu" and torch.cuda.is_available():
    return "cuda"
  if jax.default_backend() == "cpu":
    return "cpu"
  return None


def check_attention(small: bool) -> dict:
  from cmimem_jax.models.attention import causal_self_attention
  platform = jax.default_backend()
  backend = {"gpu": "cudnn", "tpu": "splash"}.get(platform)
  if backend is None:
    return {"skipped": f"no accelerator attention backend on {platform} "
                       "(cuDNN needs a GPU, splash a TPU; "
                       "tests/models/test_attention.py runs splash in "
                       "interpret mode)"}
  b, t, heads, kv, dim = (2, 256, 4, 2, 64) if small else (4, 4096, 32, 8,
                                                           128)
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (b, t, heads, dim), jnp.bfloat16)
  k = jax.random.normal(keys[1], (b, t, kv, dim), jnp.bfloat16)
  v = jax.random.normal(keys[2], (b, t, kv, dim), jnp.bfloat16)
  segments = jnp.ones((b, t), jnp.int32).at[0, : t // 4].set(0)
  cotangent = jax.random.normal(keys[3], q.shape, jnp.float32)

  def run(impl):
    def loss(q, k, v):
      out = causal_self_attention(q, k, v, segments, impl)
      return jnp.sum(out.astype(jnp.float32) * cotangent)
    out = jax.jit(lambda q, k, v: causal_self_attention(q, k, v, segments,
                                                        impl))
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return out, grads

  out_fast, grad_fast = run(backend)
  out_xla, grad_xla = run("batched")
  valid = np.asarray(segments)[..., None, None] > 0
  forward = np.abs(np.asarray(out_fast(q, k, v), np.float32)
                   - np.asarray(out_xla(q, k, v), np.float32))
  grads = [np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b_,
                                                               np.float32)))
           for a, b_ in zip(grad_fast(q, k, v), grad_xla(q, k, v))]
  fast_s = best_time(lambda: grad_fast(q, k, v))
  xla_s = best_time(lambda: grad_xla(q, k, v))
  return {"backend": backend, "shape": [b, t, heads, kv, dim],
          "max_abs_diff_forward": float(np.max(np.where(valid, forward, 0))),
          "max_abs_diff_grads": float(max(grads)),
          "forward_backward_speedup_vs_xla": round(xla_s / fast_s, 2)}


def _random_pair(preset_name: str, directory: str, **overrides):
  """Random weights as a transformers model (torch) and our Flax model."""
  import torch
  import transformers

  from cmimem_jax.models.qwen3 import load_hf, preset
  config = preset(preset_name, **overrides)
  torch.manual_seed(0)
  reference = transformers.AutoModelForCausalLM.from_config(
      transformers.AutoConfig.for_model(**config.to_hf()),
      torch_dtype=torch.float32).eval()
  reference.save_pretrained(directory, safe_serialization=True)
  return reference, load_hf(directory)


def check_sampler(small: bool) -> dict:
  device = _torch_device()
  if device is None:
    return {"skipped": "torch with this device is not installed"}
  import torch

  from cmimem_jax.sampling import Sampler, SamplingConfig
  name, overrides = (("tiny", {}) if small else ("qwen3_0p6b", {}))
  batch, prompt, new = (2, 32, 16) if small else (8, 512, 256)
  with tempfile.TemporaryDirectory() as directory:
    reference, ours = _random_pair(name, directory, **overrides)
  reference = reference.to(device)
  rng = np.random.default_rng(0)
  prompts = rng.integers(1, ours.config.vocab_size, (batch, prompt))
  sampler = Sampler(ours, SamplingConfig(temperature=0.0, max_new_tokens=new,
                                         eos_ids=()), buckets=(prompt,))
  key = jax.random.key(0)
  start = time.perf_counter()
  out = sampler(prompts.tolist(), key)
  compile_s = time.perf_counter() - start
  ours_s = best_time(lambda: sampler(prompts.tolist(), key).tokens, 2)
  tprompts = torch.from_numpy(prompts).to(device)

  def generate():
    with torch.no_grad():
      result = reference.generate(
          tprompts, attention_mask=torch.ones_like(tprompts),
          max_new_tokens=new, min_new_tokens=new, do_sample=False,
          use_cache=True, pad_token_id=0)
    if device == "cuda":
      torch.cuda.synchronize()
    return result
  want = generate()[:, prompt:].cpu().numpy()
  torch_s = best_time(generate, 2)
  return {"model": name, "batch": batch, "prompt": prompt, "new_tokens": new,
          "torch_device": device,
          "ours_tokens_per_s": round(batch * new / ours_s, 1),
          "transformers_tokens_per_s": round(batch * new / torch_s, 1),
          "speedup_vs_transformers": round(torch_s / ours_s, 2),
          "greedy_token_agreement": float(np.mean(out.tokens == want)),
          "compile_s": round(compile_s, 1)}


def check_grpo_step(small: bool) -> dict:
  """One GRPO step of the object `train` runs (`task.loop.grpo_step` of a
  training config: its learner, its sampler decoding on
  `rollout.decode_devices`, its loss and optimizer) on random prompts,
  with a token-diversity reward: rollout and update times, tokens/s and
  the device's peak memory. Full size: configs/qwen3_4b_tpu.py's settings
  on a Qwen3-0.6B-shape random policy (bf16 compute, full remat, the
  rows and KV caches split over the mesh), 4 rollouts of 3,840-token
  prompts x 256 new tokens per device; small: configs/tiny.py."""
  from flax import nnx

  from cmimem_jax.models.qwen3 import Qwen3
  from cmimem_jax.parallel import make_mesh
  from cmimem_jax.rl import Scores
  from cmimem_jax.sampling import load_tokenizer
  from cmimem_jax.sampling.policy import PolicyConfig, random_policy_config
  from cmimem_jax.config import validate_config
  from cmimem_jax.task.loop import GRPO_STEP_SECTIONS, grpo_step
  from configs import qwen3_4b_tpu, tiny
  devices = len(jax.devices())
  config = (tiny if small else qwen3_4b_tpu).get_config()
  prompt, new, group = (48, 16, 2) if small else (3840, 256, 4)
  config.mesh = "fsdp:-1"
  config.rollout.update({"num_rollouts": group, "max_new_tokens": new,
                         "max_prompt_tokens": prompt, "buckets": (prompt,),
                         "max_rows_per_wave": 0})
  config.rl.update({"sessions_per_batch": devices, "micro_batches": 1})
  if not small:
    config.policy.update({"source": "random", "preset": "qwen3_0p6b"})
    if jax.default_backend() == "cpu":
      config.policy.dtype = "float32"
  tokenizer = load_tokenizer("")
  model = Qwen3(random_policy_config(PolicyConfig.from_config(config.policy),
                                    len(tokenizer)),
                rngs=nnx.Rngs(0))
  config.rl.snapshots = "policy"  # No snapshots are loaded here.
  step = grpo_step(validate_config(config, GRPO_STEP_SECTIONS), model,
                   tokenizer, make_mesh(config.mesh))
  rng = np.random.default_rng(0)
  prompts = rng.integers(1, len(tokenizer), (devices, prompt)).tolist()

  def reward(rollouts) -> Scores:
    return Scores(np.array([len(set(c)) / new
                            for c in rollouts.completions]))

  start = time.perf_counter()
  step(prompts, jax.random.key(0), reward)
  compile_s = time.perf_counter() - start
  timed = []
  for i in range(2):
    start = time.perf_counter()
    metrics = step(prompts, jax.random.key(i + 1), reward).metrics
    timed.append((time.perf_counter() - start, metrics))
  step_s, metrics = min(timed, key=lambda t: t[0])
  rows = devices * group
  stats = jax.devices()[0].memory_stats() or {}
  return {"model": config.policy.preset, "mesh": dict(step.learner.mesh.shape),
          "decode_devices": config.rollout.decode_devices, "rows": rows,
          "length": prompt + new, "dtype": config.policy.dtype,
          "step_s": round(step_s, 3),
          "sample_s": round(metrics["sample_s"], 3),
          "update_s": round(metrics["step_time_s"], 3),
          "rollout_tokens_per_s": round(rows * new / metrics["sample_s"], 1),
          "train_tokens_per_s": round(metrics["tokens_per_s"], 1),
          "compile_s": round(compile_s, 1),
          "peak_bytes_in_use": stats.get("peak_bytes_in_use")}


def check_cmi_kernel(small: bool) -> dict:
  from cmimem_jax.cmi import residual_cmi
  batch, n, d = (64, 8, 64) if small else (8192, 20, 1024)
  rng = np.random.default_rng(0)
  e_ctx = rng.normal(size=(batch, d)).astype(np.float32)
  e_new = rng.normal(size=(batch, d)).astype(np.float32)
  mem = rng.normal(size=(batch, n, d)).astype(np.float32)
  mask = rng.random((batch, n)) < 0.9
  mask[:, :2] = True
  args = [jnp.asarray(x) for x in (e_ctx, e_new, mem, mask)]
  ours = np.asarray(residual_cmi(*args))
  ours_s = best_time(lambda: residual_cmi(*args))
  result = {"B": batch, "N": n, "d": d, "ours_ms": round(ours_s * 1e3, 2)}
  device = _torch_device()
  if device is None:
    return {**result, "torch": "not installed"}
  import torch
  t = [torch.from_numpy(x).to(device) for x in (e_ctx, e_new, mem, mask)]

  def peer():
    unit = lambda x: x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)  # noqa
    q = unit(torch.stack([t[0], t[1]], 1))
    m = unit(t[2]) * t[3][..., None]
    gram = m @ m.transpose(1, 2) + 1e-4 * torch.eye(n, device=device)
    coefficients = torch.cholesky_solve(m @ q.transpose(1, 2),
                                        torch.linalg.cholesky(gram))
    res = q - coefficients.transpose(1, 2) @ m
    a, b = res[:, 0], res[:, 1]
    na, nb = a.norm(dim=-1), b.norm(dim=-1)
    rho = torch.where((na < 1e-6) | (nb < 1e-6), torch.zeros_like(na),
                      (a * b).sum(-1) / (na * nb).clamp_min(1e-30))
    cos = (q[:, 0] * q[:, 1]).sum(-1)
    rho = torch.where(t[3].sum(-1) < 2, cos, rho)
    if device == "cuda":
      torch.cuda.synchronize()
    return rho
  with torch.no_grad():
    want = peer().cpu().numpy()
    torch_s = best_time(peer)
  return {**result, "torch_device": device,
          "torch_ms": round(torch_s * 1e3, 2),
          "speedup_vs_torch": round(torch_s / ours_s, 2),
          "max_abs_diff_vs_torch": float(np.max(np.abs(ours - want)))}


def check_vllm(small: bool) -> dict:
  del small
  try:
    import vllm  # noqa: F401
  except ImportError:
    return {"skipped": "vLLM is not installed"}
  from cmimem_jax.models.qwen3 import Qwen3, preset
  from cmimem_jax.models.qwen3.params import save_hf
  from cmimem_jax.sampling.vllm_engine import VLLMEngine
  from flax import nnx
  model = Qwen3(preset("qwen3_0p6b"), rngs=nnx.Rngs(0))
  with tempfile.TemporaryDirectory() as directory:
    save_hf(model, directory)
    start = time.perf_counter()
    engine = VLLMEngine(directory, (), 0, (64,),
                        gpu_memory_utilization=0.3, max_model_len=512)
    startup_s = time.perf_counter() - start
    prompts = [[1 + i, 2, 3, 4] for i in range(8)]
    out = engine.generate(prompts, jax.random.key(0), 0.0, 1.0, 32)
    start = time.perf_counter()
    engine.set_model(model)
    push_s = time.perf_counter() - start
    return {"rows": len(prompts), "tokens": int(out.lengths.sum()),
            "startup_s": round(startup_s, 1),
            "weight_push": engine.last_push, "push_s": round(push_s, 2)}


CHECKS = {"attention": check_attention, "sampler": check_sampler,
          "grpo_step": check_grpo_step, "cmi_kernel": check_cmi_kernel,
          "vllm": check_vllm}


# This tool's flags (its own: tools share flag names).
FLAGS = flags.FlagValues()
flags.DEFINE_bool("small", False, "Small shapes (CPU test suite).",
                  flag_values=FLAGS)
flags.DEFINE_string("checks", ",".join(CHECKS), "Comma-separated subset of "
                    + ",".join(CHECKS) + ".", flag_values=FLAGS)


def main(argv: list[str]) -> list[dict]:
  del argv
  args = FLAGS
  results = []
  device = jax.devices()[0]
  for name in args.checks.split(","):
    start = time.perf_counter()
    try:
      record = CHECKS[name](args.small)
    except Exception as e:  # noqa: BLE001 - reported, the others still run.
      record = {"error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc()[-2000:]}
    record = {"check": name, "platform": device.platform,
              "device": device.device_kind, "devices": len(jax.devices()),
              **record, "wall_s": round(time.perf_counter() - start, 1)}
    print(json.dumps(record), flush=True)
    results.append(record)
  return results


if __name__ == "__main__":
  # Its timings are measured: nothing loaded from a compilation cache.
  run_command(main, flag_values=FLAGS, compilation_cache=False)
