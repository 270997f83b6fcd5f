"""Benchmarks: our JAX code against named peers, measured in the same run.

  python -m tools.bench cmi [--scenario=kernel|workload|all] [--devices=2]
  python -m tools.bench forward|generate [--models=qwen3_0p6b,smollm2_135m]
  python -m tools.bench train_step [--model=smollm2_135m --layers=8]
  python -m tools.bench grpo_step [--prompts=4 --group=4 --new_tokens=64]
  python -m tools.bench offsets [--tokens=6000]

Prints one JSON line per case. Every speedup is peer time / our time, each
the best of `--reps` timed runs after a warm-up (compile excluded; compile
time is reported separately).

Scenarios:
  kernel    random [B, N, d] inputs; peers: a per-operation NumPy loop
            (np.linalg.solve per row) and the same math batched in PyTorch
            (cholesky / cholesky_solve over the batch). Ours runs on one
            CPU device and sharded over `--devices` CPU devices.
  workload  one GRPO step's CMI: 32 banks x 300 entries, 8 rollouts x 12
            operations per bank, App. F conditioning sets (top-8 + 2 recent);
            from banks and operations to per-rollout CMI rewards. Peers: the
            per-operation NumPy loop and PyTorch gathering every set into
            [B, N, d] and running the batched kernel.
  grpo_step one whole GRPO step of SmolLM2-135M-Instruct (the embedded
            weights): sample `group` completions of `new_tokens` tokens for
            each prompt, score them with a reward both sides share, one
            AdamW update with the k3 KL to the frozen reference. Peer:
            Hugging Face TRL's `GRPOTrainer` (the `bench` extra) with the
            same prompts, weights, group size, token budget, sampling
            settings, loss aggregation, optimizer and float32.
  offsets   a response's attribution offsets (`task.episode.
            token_char_offsets`, incremental detokenization) against the
            prefix decoding it replaced (`prefix_char_offsets`), SmolLM2's
            tokenizer, a DSL response with multi-byte text.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
import types
from collections.abc import Callable

# With several CPU devices each calling LAPACK (the N > 12 Cholesky) while
# torch's OpenMP pool is alive, a threaded OpenBLAS was seen to deadlock
# here; one BLAS thread per caller avoids it (the peers' tiny solves are
# single-threaded anyway). Read when OpenBLAS loads: before numpy.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from absl import app, flags  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from cmimem_jax.cmi import banked_rho, residual_cmi  # noqa: E402
from cmimem_jax.cmi.conditioning import ConditioningConfig  # noqa: E402
from cmimem_jax.config import run_command  # noqa: E402
from cmimem_jax.models.attention import ATTENTION_IMPLS  # noqa: E402
from cmimem_jax.task.reward import gaussian_shaping  # noqa: E402

# This tool's flags (its own: tools share flag names). The scenario is the
# first positional argument; each takes the flags of its `SETTINGS` entry,
# each at that entry's default unless given.
FLAGS = flags.FlagValues()
flags.DEFINE_enum("scenario", None, ["kernel", "workload", "all"],
                  "cmi: the CMI scenarios run.", flag_values=FLAGS)
flags.DEFINE_integer("devices", None, "CPU devices to shard over (cmi: the "
                     "kernel batch; grpo_step: our step's rows).",
                     flag_values=FLAGS)
flags.DEFINE_integer("reps", None, "Timed runs (the best is reported).",
                     flag_values=FLAGS)
flags.DEFINE_bool("quick", None, "cmi: smallest cases only (smoke test).",
                  flag_values=FLAGS)
flags.DEFINE_string("models", None, "forward / generate: comma-separated "
                    "presets (random weights).", flag_values=FLAGS)
flags.DEFINE_string("model", None, "train_step: the preset.",
                    flag_values=FLAGS)
flags.DEFINE_integer("layers", None, "Override the layer count (0: the "
                     "preset's; grpo_step: keep the first N decoder layers, "
                     "0: all 30).", flag_values=FLAGS)
flags.DEFINE_integer("batch", None, "Rows.", flag_values=FLAGS)
flags.DEFINE_integer("length", None, "Tokens per row (forward), prompt "
                     "length (generate), prompt + completion tokens per row "
                     "(train_step).", flag_values=FLAGS)
flags.DEFINE_integer("new_tokens", None, "Tokens generated per row.",
                     flag_values=FLAGS)
flags.DEFINE_enum("attention_impl", None, ATTENTION_IMPLS,
                  "Our decoders' attention backend.", flag_values=FLAGS)
flags.DEFINE_float("kl_beta", None, "train_step: > 0 adds the reference "
                   "forward (ideal ratio ~4); grpo_step: the k3 KL weight.",
                   flag_values=FLAGS)
flags.DEFINE_integer("completion", None, "train_step: completion columns "
                     "per row (0: half the row).", flag_values=FLAGS)
flags.DEFINE_integer("group", None, "train_step: rows per shared prompt: "
                     "> 1 also times the step over whole rows against the "
                     "one that runs each prompt once "
                     "(rl.TrainStepConfig.share_prompts); grpo_step: "
                     "completions per prompt (GRPO's N).", flag_values=FLAGS)
flags.DEFINE_enum("remat", None, ["none", "full", "dots"], "train_step: the "
                  "layers' rematerialisation (Qwen3Config.remat).",
                  flag_values=FLAGS)
flags.DEFINE_bool("frozen_weights", None, "train_step: also time the "
                  "update's gradient alone with every parameter trainable "
                  "and with only the RMSNorm scales trainable: the floor of "
                  "an adapter (LoRA) update, which computes no weight "
                  "gradient.", flag_values=FLAGS)
flags.DEFINE_integer("prompts", None, "grpo_step: prompts per step.",
                     flag_values=FLAGS)
flags.DEFINE_integer("steps", None, "grpo_step: timed steps per side, after "
                     "one warm-up step.", flag_values=FLAGS)
flags.DEFINE_float("temperature", None, "grpo_step: sampling temperature.",
                   flag_values=FLAGS)
flags.DEFINE_float("top_p", None, "grpo_step: nucleus sampling's p.",
                   flag_values=FLAGS)
flags.DEFINE_float("learning_rate", None, "grpo_step: AdamW's rate.",
                   flag_values=FLAGS)
flags.DEFINE_bool("whole_rows", None, "grpo_step: our update runs every row "
                  "whole, as the peers do "
                  "(rl.TrainStepConfig.share_prompts=False).",
                  flag_values=FLAGS)
flags.DEFINE_string("peers", None, "grpo_step: comma-separated: trl (the "
                    "`bench` extra), tunix (installed as BENCHMARKS.md "
                    "says).", flag_values=FLAGS)
flags.DEFINE_integer("tokens", None, "offsets: the response's tokens.",
                     flag_values=FLAGS)

_MODEL = {"models": "qwen3_0p6b,smollm2_135m", "layers": 0, "batch": 4,
          "new_tokens": 128, "devices": 1, "attention_impl": "auto"}
# Each scenario's flags and their defaults.
SETTINGS = {
    "cmi": {"scenario": "all", "devices": os.cpu_count() or 1, "reps": 3,
            "quick": False},
    "forward": {**_MODEL, "length": 512, "reps": 4},
    "generate": {**_MODEL, "length": 128, "reps": 2},
    "train_step": {"model": "smollm2_135m", "layers": 8, "batch": 4,
                   "length": 256, "kl_beta": 0.0, "reps": 3, "devices": 1,
                   "attention_impl": "auto", "completion": 0, "group": 1,
                   "remat": "none", "frozen_weights": False},
    # One XLA CPU device already runs its intra-op work on every core;
    # sharding the rows over one device per core was slower (BENCHMARKS.md).
    "grpo_step": {"prompts": 4, "group": 4, "new_tokens": 64, "steps": 3,
                  "temperature": 1.0, "top_p": 1.0, "kl_beta": 0.02,
                  "learning_rate": 1e-6, "layers": 0, "devices": 1,
                  "whole_rows": False, "peers": "trl"},
    "offsets": {"tokens": 6000, "reps": 3, "devices": 1},
}
# The settings of the scenario run (`main`).
ARGS = types.SimpleNamespace()


def scenario_settings(argv: list[str]) -> types.SimpleNamespace:
  """The scenario `argv` names (its only positional argument) and its
  settings: each of its flags as given, else at its default.

  Raises:
    app.UsageError: no known scenario, or a flag it does not take.
  """
  if len(argv) != 2 or argv[1] not in SETTINGS:
    raise app.UsageError(f"give one scenario of {', '.join(SETTINGS)}, got "
                         f"{' '.join(argv[1:]) or 'none'}")
  command, defaults = argv[1], SETTINGS[argv[1]]
  foreign = [f"--{name}" for name in FLAGS
             if FLAGS[name].present and name not in defaults]
  if foreign:
    raise app.UsageError(f"{command} takes no {', '.join(foreign)}")
  return types.SimpleNamespace(command=command, **{
      name: FLAGS[name].value if FLAGS[name].present else default
      for name, default in defaults.items()})


LAM = 1e-4


# Fast cases repeat until their runs add up to this much (as `timeit`'s
# autorange): the best of 5 runs of a 0.5 ms call is mostly this shared
# machine's noise, the best of ~1,000 is the call.
MIN_TIMED_S = 0.5
MAX_REPS = 1000


def best_time(fn: Callable[[], object], reps: int) -> float:
  """Best wall time of at least `reps` runs after one warm-up run, more
  (up to `MAX_REPS`) until they total `MIN_TIMED_S`."""
  jax.block_until_ready(fn())
  times: list[float] = []
  while len(times) < reps or (sum(times) < MIN_TIMED_S
                              and len(times) < MAX_REPS):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return min(times)


# --- peers ------------------------------------------------------------------

def numpy_rho(e_ctx: np.ndarray, e_new: np.ndarray, mem: np.ndarray,
              lam: float = LAM, min_memories: int = 2) -> float:
  """One operation, the straightforward way (mem: valid rows only)."""
  unit = lambda v: v / max(np.linalg.norm(v), 1e-12)  # noqa: E731
  c, n = unit(e_ctx), unit(e_new)
  if len(mem) < min_memories:
    return float(c @ n)
  m = mem / np.maximum(np.linalg.norm(mem, axis=1, keepdims=True), 1e-12)
  gram = m @ m.T + lam * np.eye(len(m), dtype=m.dtype)
  queries = np.stack([c, n], axis=1)
  res = queries - m.T @ np.linalg.solve(gram, m @ queries)
  norm_c, norm_n = np.linalg.norm(res, axis=0)
  if norm_c < 1e-6 or norm_n < 1e-6:
    return 0.0
  return float(res[:, 0] @ res[:, 1] / (norm_c * norm_n))


def torch_residuals(queries: torch.Tensor, mem: torch.Tensor,
                    mask: torch.Tensor, lam: float = LAM) -> torch.Tensor:
  """The same math batched in PyTorch: `[B, K, d]` residuals."""
  unit = lambda x: x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)  # noqa
  q = unit(queries)
  m = unit(mem) * mask[..., None]
  gram = m @ m.transpose(1, 2) + lam * torch.eye(m.shape[1])
  factor = torch.linalg.cholesky(gram)
  coefficients = torch.cholesky_solve(m @ q.transpose(1, 2), factor)
  return q - coefficients.transpose(1, 2) @ m


def torch_rho(res: torch.Tensor, first: int, second: int) -> torch.Tensor:
  a, b = res[:, first], res[:, second]
  dot = (a * b).sum(-1)
  na, nb = a.norm(dim=-1), b.norm(dim=-1)
  degenerate = (na < 1e-6) | (nb < 1e-6)
  return torch.where(degenerate, torch.zeros_like(dot),
                     dot / (na * nb).clamp_min(1e-30))


def torch_kernel(e_ctx, e_new, mem, mask, min_memories=2):
  res = torch_residuals(torch.stack([e_ctx, e_new], 1), mem, mask)
  rho = torch_rho(res, 0, 1)
  unit = lambda x: x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)  # noqa
  cos = (unit(e_ctx) * unit(e_new)).sum(-1)
  return torch.where(mask.sum(-1) < min_memories, cos, rho)


# --- kernel scenario --------------------------------------------------------

def kernel_case(batch: int, n: int, d: int, mesh: Mesh,
                nearly_stored: float = 0.0) -> dict:
  """Random rows; a `nearly_stored` fraction of them has a fragment within
  1 % of a stored memory (the kernel's anchored pass runs on those)."""
  rng = np.random.default_rng(batch + n + d)
  e_ctx = rng.normal(size=(batch, d)).astype(np.float32)
  e_new = rng.normal(size=(batch, d)).astype(np.float32)
  mem = rng.normal(size=(batch, n, d)).astype(np.float32)
  mask = rng.random((batch, n)) < 0.9
  mask[:, :2] = True
  stored = rng.random(batch) < nearly_stored
  e_new[stored] = mem[stored, 0] + 0.01 * rng.normal(
      size=(int(stored.sum()), d)).astype(np.float32)

  args = [jnp.asarray(x) for x in (e_ctx, e_new, mem, mask)]
  start = time.perf_counter()
  ours = np.asarray(residual_cmi(*args))
  compile_s = time.perf_counter() - start
  ours_s = best_time(lambda: residual_cmi(*args), ARGS.reps)
  devices = mesh.devices.size
  sharded_s = None
  if batch % devices == 0 and devices > 1:
    spec = lambda x: NamedSharding(  # noqa: E731
        mesh, PartitionSpec("batch", *([None] * (x.ndim - 1))))
    placed = [jax.device_put(x, spec(x)) for x in args]
    sharded_s = best_time(lambda: residual_cmi(*placed), ARGS.reps)

  tensors = [torch.from_numpy(x.copy()) for x in (e_ctx, e_new, mem, mask)]
  with torch.no_grad():
    peer = torch_kernel(*tensors).numpy()
    torch_s = best_time(lambda: torch_kernel(*tensors), ARGS.reps)
  start = time.perf_counter()
  loop = np.array([numpy_rho(e_ctx[i], e_new[i], mem[i][mask[i]])
                   for i in range(batch)])
  loop_s = time.perf_counter() - start

  best = min(ours_s, sharded_s or ours_s)
  flops = batch * d * 2 * (n * n + 6 * n)  # Gram + 3 [K=2] products.
  bytes_read = 4 * batch * d * (n + 2)
  return {
      "scenario": "kernel", "B": batch, "N": n, "d": d,
      "nearly_stored": nearly_stored,
      "speedup_vs_numpy_loop": round(loop_s / best, 2),
      "speedup_vs_torch_batched": round(torch_s / best, 2),
      "speedup_vs_torch_batched_1dev": round(torch_s / ours_s, 2),
      "ours_ms": round(ours_s * 1e3, 2),
      f"ours_{devices}dev_ms": (None if sharded_s is None
                                else round(sharded_s * 1e3, 2)),
      "torch_batched_ms": round(torch_s * 1e3, 2),
      "numpy_loop_ms": round(loop_s * 1e3, 1),
      "ours_gflops": round(flops / best / 1e9, 1),
      "ours_input_gbps": round(bytes_read / best / 1e9, 2),
      "compile_s": round(compile_s, 2),
      "max_abs_diff_vs_torch": float(np.max(np.abs(ours - peer))),
      "max_abs_diff_vs_numpy_loop": float(np.max(np.abs(ours - loop))),
  }


# --- workload scenario ------------------------------------------------------

BANKS, ENTRIES, ROLLOUTS, OPS = 32, 300, 8, 12


def workload_inputs(d: int) -> dict:
  rng = np.random.default_rng(d)
  ops = ROLLOUTS * OPS
  return {
      "vectors": rng.normal(size=(BANKS, ENTRIES, d)).astype(np.float32),
      "valid": np.ones((BANKS, ENTRIES), bool),
      "recent": np.tile(np.array([[ENTRIES - 1, ENTRIES - 2]]), (BANKS, 1)),
      "e_ctx": rng.normal(size=(BANKS, d)).astype(np.float32),
      "e_new": rng.normal(size=(BANKS, ops, d)).astype(np.float32),
      "e_old": rng.normal(size=(BANKS, ops, d)).astype(np.float32),
      "has_old": rng.random((BANKS, ops)) < 1 / 3,
  }


def rollout_rewards(rho_new: np.ndarray, rho_old: np.ndarray,
                    has_old: np.ndarray) -> np.ndarray:
  """Eq. 10-11 and the per-rollout mean: `[Bk, O]` -> `[Bk, rollouts]`."""
  score = np.where(has_old, rho_new - rho_old, np.maximum(rho_new, 0.0))
  shaped = gaussian_shaping(score, 0.35, 0.15)
  return shaped.reshape(BANKS, ROLLOUTS, OPS).mean(-1)


def ours_workload(inputs: dict, config: ConditioningConfig) -> np.ndarray:
  rho_new, rho_old, _, _ = banked_rho(
      inputs["vectors"], inputs["valid"], inputs["recent"], inputs["e_ctx"],
      inputs["e_new"], inputs["e_old"], inputs["has_old"], lam=LAM,
      config=config)
  return rollout_rewards(np.asarray(rho_new), np.asarray(rho_old),
                         np.asarray(inputs["has_old"]))


def _query_weights(has_old, config):
  return config.w_context, config.w_new, config.w_old * has_old


def torch_workload(tensors: dict, config: ConditioningConfig) -> np.ndarray:
  unit = lambda x: x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)  # noqa
  v, ctx = unit(tensors["vectors"]), unit(tensors["e_ctx"])
  new, old = unit(tensors["e_new"]), unit(tensors["e_old"])
  has_old = tensors["has_old"]
  w_c, w_n, w_o = _query_weights(has_old.float(), config)
  query = w_c * ctx[:, None] + w_n * new + w_o[..., None] * old
  scores = query @ v.transpose(1, 2)  # [Bk, O, M]
  top = scores.topk(config.top_k, dim=-1).indices
  recent = tensors["recent"][:, None, :].expand(-1, top.shape[1], -1)
  fresh = ~(recent[..., :, None] == top[..., None, :]).any(-1)
  index = torch.cat([top, recent], -1)
  mask = torch.cat([torch.ones_like(top, dtype=torch.bool), fresh], -1)
  flat = index.reshape(BANKS, -1)
  rows = torch.gather(v, 1, flat[..., None].expand(-1, -1, v.shape[-1]))
  rows = rows.reshape(BANKS * index.shape[1], index.shape[2], -1)
  queries = torch.stack([ctx[:, None].expand_as(new), new, old], 2)
  res = torch_residuals(queries.reshape(-1, 3, queries.shape[-1]), rows,
                        mask.reshape(-1, index.shape[2]).float())
  rho_new = torch_rho(res, 0, 1).reshape(BANKS, -1).numpy()
  rho_old = torch_rho(res, 0, 2).reshape(BANKS, -1).numpy()
  return rollout_rewards(rho_new, rho_old, has_old.numpy())


def numpy_workload(inputs: dict, config: ConditioningConfig) -> np.ndarray:
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa
  rho_new = np.zeros(inputs["has_old"].shape)
  rho_old = np.zeros(inputs["has_old"].shape)
  for b in range(BANKS):
    v = unit(inputs["vectors"][b])
    ctx = unit(inputs["e_ctx"][b])
    for o in range(inputs["e_new"].shape[1]):
      new, old = unit(inputs["e_new"][b, o]), unit(inputs["e_old"][b, o])
      has_old = inputs["has_old"][b, o]
      query = (config.w_context * ctx + config.w_new * new
               + (config.w_old * old if has_old else 0))
      top = list(np.argsort(-(v @ query))[:config.top_k])
      chosen = top + [r for r in inputs["recent"][b] if r not in top]
      rho_new[b, o] = numpy_rho(ctx, new, v[chosen])
      if has_old:
        rho_old[b, o] = numpy_rho(ctx, old, v[chosen])
  return rollout_rewards(rho_new, rho_old, inputs["has_old"])


def workload_case(d: int, mesh: Mesh) -> dict:
  config = ConditioningConfig()
  inputs = workload_inputs(d)
  # Banks are independent: shard them over the CPU devices. Inputs start on
  # device, as torch's start as tensors (banks persist across steps).
  placed = {k: jax.device_put(v, NamedSharding(mesh, PartitionSpec(
      "batch", *([None] * (v.ndim - 1))))) for k, v in inputs.items()}
  start = time.perf_counter()
  ours = ours_workload(placed, config)
  compile_s = time.perf_counter() - start
  ours_s = best_time(lambda: ours_workload(placed, config), ARGS.reps)
  tensors = {k: torch.from_numpy(np.ascontiguousarray(v))
             for k, v in inputs.items()}
  with torch.no_grad():
    peer = torch_workload(tensors, config)
    torch_s = best_time(lambda: torch_workload(tensors, config), ARGS.reps)
  start = time.perf_counter()
  loop = numpy_workload(inputs, config)
  loop_s = time.perf_counter() - start
  ops = BANKS * ROLLOUTS * OPS
  return {
      "scenario": "workload", "B": ops, "N": config.size, "d": d,
      "banks": BANKS, "entries": ENTRIES, "devices": mesh.devices.size,
      "speedup_vs_numpy_loop": round(loop_s / ours_s, 2),
      "speedup_vs_torch_batched": round(torch_s / ours_s, 2),
      "ours_ms": round(ours_s * 1e3, 2),
      "torch_batched_ms": round(torch_s * 1e3, 2),
      "numpy_loop_ms": round(loop_s * 1e3, 1),
      # Bank-level GEMMs (scores of 1 + 2·O queries, Gram) dominate.
      "ours_gflops": round(2 * BANKS * ENTRIES * d * (
          1 + 2 * ROLLOUTS * OPS + ENTRIES) / ours_s / 1e9, 1),
      "compile_s": round(compile_s, 2),
      "max_abs_reward_diff_vs_torch": float(np.max(np.abs(ours - peer))),
      "max_abs_reward_diff_vs_numpy_loop": float(np.max(np.abs(ours - loop))),
  }


def run_cmi() -> None:
  torch.set_num_threads(os.cpu_count() or 1)
  mesh = Mesh(np.array(jax.devices()), ("batch",))
  if ARGS.scenario in ("kernel", "all"):
    batches = (64,) if ARGS.quick else (64, 1024, 8192)
    for d in (384,) if ARGS.quick else (384, 1024):
      for n in (8,) if ARGS.quick else (8, 20):
        for batch in batches:
          print(json.dumps(kernel_case(batch, n, d, mesh)), flush=True)
    if not ARGS.quick:  # What the anchored pass costs at the largest row.
      print(json.dumps(kernel_case(8192, 20, 1024, mesh, nearly_stored=0.2)),
            flush=True)
  if ARGS.scenario in ("workload", "all"):
    for d in (384,) if ARGS.quick else (384, 1024):
      print(json.dumps(workload_case(d, mesh)), flush=True)


# --- model scenarios ----------------------------------------------------------

def _model_pair(name: str, workdir: str):
  """The same random weights in transformers (fp32) and in our Flax model."""
  import transformers

  from cmimem_jax.models.qwen3 import load_hf, preset
  overrides = {"num_hidden_layers": ARGS.layers} if ARGS.layers else {}
  config = preset(name, attention_impl=ARGS.attention_impl, **overrides)
  hf_config = transformers.AutoConfig.for_model(**config.to_hf())
  torch.manual_seed(0)
  reference = transformers.AutoModelForCausalLM.from_config(
      hf_config, torch_dtype=torch.float32).eval()
  directory = os.path.join(workdir, name)
  reference.save_pretrained(directory, safe_serialization=True)
  return reference, load_hf(directory), config


def _print_model_result(scenario: str, name: str, config, tokens: int,
                        ours_s: float, torch_s: float, compile_s: float,
                        **extra) -> None:
  print(json.dumps({
      "scenario": scenario, "model": name,
      "layers": config.num_hidden_layers, "batch": ARGS.batch,
      "speedup_vs_transformers": round(torch_s / ours_s, 2),
      "ours_tokens_per_s": round(tokens / ours_s, 1),
      "transformers_tokens_per_s": round(tokens / torch_s, 1),
      "ours_s": round(ours_s, 3), "transformers_s": round(torch_s, 3),
      "compile_s": round(compile_s, 1), **extra}), flush=True)


def _model_pairs():
  """(name, reference, ours, config, rng) for each `--models` preset."""
  import tempfile
  torch.set_num_threads(os.cpu_count() or 1)
  for name in ARGS.models.split(","):
    with tempfile.TemporaryDirectory() as workdir:
      reference, ours, config = _model_pair(name, workdir)
      yield name, reference, ours, config, np.random.default_rng(0)


def run_forward() -> None:
  for name, reference, ours, config, rng in _model_pairs():
    tokens = rng.integers(0, config.vocab_size, (ARGS.batch, ARGS.length))
    mask = np.ones_like(tokens)
    jtokens, jmask = jnp.asarray(tokens, jnp.int32), jnp.asarray(mask)
    forward = nnx_jit_forward()
    start = time.perf_counter()
    logits = forward(ours, jtokens, jmask)
    jax.block_until_ready(logits)
    compile_s = time.perf_counter() - start
    ours_s = best_time(lambda: forward(ours, jtokens, jmask), ARGS.reps)
    ttokens = torch.from_numpy(tokens)
    with torch.no_grad():
      want = reference(input_ids=ttokens).logits.numpy()
      torch_s = best_time(lambda: reference(input_ids=ttokens).logits,
                          ARGS.reps)
    _print_model_result(
        "forward", name, config, ARGS.batch * ARGS.length, ours_s, torch_s,
        compile_s, length=ARGS.length, max_abs_logit_diff=float(
            np.max(np.abs(np.asarray(logits) - want))))


def nnx_jit_forward():
  from flax import nnx

  from cmimem_jax.models.qwen3 import positions_from_mask

  @functools.partial(nnx.jit, graph=False)
  def forward(model, tokens, mask):
    logits, _ = model(tokens, positions_from_mask(mask), mask)
    return logits
  return forward


def run_generate() -> None:
  from cmimem_jax.sampling import Sampler, SamplingConfig
  for name, reference, ours, config, rng in _model_pairs():
    prompts = rng.integers(1, config.vocab_size, (ARGS.batch, ARGS.length))
    sampler = Sampler(ours, SamplingConfig(
        temperature=0.0, max_new_tokens=ARGS.new_tokens, eos_ids=()),
        buckets=(ARGS.length,))
    key = jax.random.key(0)
    start = time.perf_counter()
    out = sampler(prompts.tolist(), key)
    compile_s = time.perf_counter() - start
    ours_s = best_time(lambda: sampler(prompts.tolist(), key).tokens,
                       ARGS.reps)
    tprompts = torch.from_numpy(prompts)
    generate = lambda: reference.generate(  # noqa: E731
        tprompts, attention_mask=torch.ones_like(tprompts),
        max_new_tokens=ARGS.new_tokens, min_new_tokens=ARGS.new_tokens,
        do_sample=False, use_cache=True, pad_token_id=0)
    with torch.no_grad():
      want = generate()[:, ARGS.length:].numpy()
      torch_s = best_time(generate, ARGS.reps)
    _print_model_result(
        "generate", name, config, ARGS.batch * ARGS.new_tokens, ours_s,
        torch_s, compile_s, prompt=ARGS.length, new_tokens=ARGS.new_tokens,
        greedy_token_agreement=float(np.mean(out.tokens == want)))


def run_train_step() -> None:
  """GRPO train step (log-probs, loss, backward, AdamW) over a forward pass
  of the same batch, both jitted, same model: the ideal is about 3 (the
  backward costs about two forwards) plus 1 with a KL reference."""
  from flax import nnx

  from cmimem_jax.models.qwen3 import Qwen3, preset
  from cmimem_jax.parallel import make_mesh
  from cmimem_jax.rl import (GRPOLossConfig, Learner, OptimizerConfig,
                             TrainStepConfig)
  config = preset(ARGS.model, num_hidden_layers=ARGS.layers,
                  attention_impl=ARGS.attention_impl, remat=ARGS.remat)
  model = Qwen3(config, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  b, t = ARGS.batch, ARGS.length
  prompt = t - (ARGS.completion or t // 2)
  if not 0 < prompt < t or b % ARGS.group:
    raise SystemExit(f"need 0 < --completion < --length and --batch a "
                     f"multiple of --group, got {ARGS.completion}, {t}, {b}, "
                     f"{ARGS.group}")
  tokens = rng.integers(1, config.vocab_size, (b, t)).astype(np.int32)
  # Groups of `group` rows continue one prompt, as a session's rollouts do.
  tokens[:, :prompt] = np.repeat(tokens[::ARGS.group, :prompt], ARGS.group, 0)
  mask = np.ones((b, t), np.int32)
  loss_mask = np.zeros((b, t), np.int32)
  loss_mask[:, prompt:] = 1
  batch = {"tokens": tokens, "mask": mask, "loss_mask": loss_mask,
           "old_logprobs": np.full((b, t), -10.0, np.float32) * loss_mask,
           "advantages": rng.standard_normal(b).astype(np.float32),
           "token_weights": loss_mask.astype(np.float32)}
  forward = nnx_jit_forward()
  jtokens, jmask = jnp.asarray(tokens), jnp.asarray(mask)
  jax.block_until_ready(forward(model, jtokens, jmask))
  forward_s = best_time(lambda: forward(model, jtokens, jmask), ARGS.reps)

  def timed_step(share_prompts: bool) -> tuple[float, float]:
    """(compile + first step s, best step s)."""
    # A fresh copy: the learner's first step donates its weights' buffers.
    trainer = Learner(Qwen3(config, rngs=nnx.Rngs(0)), TrainStepConfig(
        loss=GRPOLossConfig(kl_beta=ARGS.kl_beta),
        optimizer=OptimizerConfig(learning_rate=1e-6),
        share_prompts=share_prompts), make_mesh("data:-1"))
    start = time.perf_counter()
    trainer.step(batch)
    return (time.perf_counter() - start,
            best_time(lambda: trainer.step(batch), ARGS.reps))

  compile_s, step_s = timed_step(True)
  line = {
      "scenario": "train_step", "model": ARGS.model, "layers": ARGS.layers,
      "batch": b, "length": t, "prompt": prompt, "group": ARGS.group,
      "kl_beta": ARGS.kl_beta, "remat": ARGS.remat,
      "devices": len(jax.devices()),
      "train_step_over_forward": round(step_s / forward_s, 2),
      "train_step_s": round(step_s, 3), "forward_s": round(forward_s, 3),
      "train_tokens_per_s": round(b * t / step_s, 1),
      "compile_s": round(compile_s, 1)}
  if ARGS.group > 1:
    whole_s = timed_step(False)[1]
    line.update(whole_rows_step_s=round(whole_s, 3),
                shared_prompt_speedup=round(whole_s / step_s, 2))
  if ARGS.frozen_weights:
    all_s, norms_s = gradient_seconds(config, batch, prompt)
    # An adapter step costs at least the frozen-weights gradient (its
    # rank-r matmuls and its AdamW over the adapters come on top), so
    # step / that gradient bounds its speed-up from above.
    line.update(gradient_s=round(all_s, 3),
                norms_only_gradient_s=round(norms_s, 3),
                adapter_gradient_speedup=round(all_s / norms_s, 2),
                adapter_step_speedup_bound=round(step_s / norms_s, 2))
  print(json.dumps(line), flush=True)


def gradient_seconds(config, batch: dict[str, np.ndarray], prompt: int
                     ) -> tuple[float, float]:
  """Best seconds of the update's gradient alone (jitted
  `rl.accumulated_grads`, the step's prompt sharing), every parameter
  trainable vs only the RMSNorm scales: the backward still runs through
  every layer, but no weight gradient is computed, as in an adapter
  update (whose rank-r matmuls would come on top)."""
  from flax import nnx

  from cmimem_jax.models.qwen3 import Qwen3
  from cmimem_jax.parallel import make_mesh
  from cmimem_jax.rl import (GRPOLossConfig, TrainStepConfig,
                             accumulated_grads, shared_prompt_group)
  graphdef, state = nnx.split(Qwen3(config, rngs=nnx.Rngs(0)), nnx.Param)
  params = nnx.to_pure_dict(state)
  mesh = make_mesh("data:-1")
  step_config = TrainStepConfig(loss=GRPOLossConfig(kl_beta=ARGS.kl_beta))
  group = shared_prompt_group(batch["tokens"], batch["mask"], prompt,
                              len(jax.devices()))
  placed = {k: jnp.asarray(batch[k]) for k in step_config.batch_keys}
  reference = params if step_config.loss.uses_reference else None
  seconds = []
  for trainable in (None, lambda path: path.endswith("norm")):
    grads = jax.jit(functools.partial(
        accumulated_grads, graphdef, step_config, mesh, start=prompt,
        group=group, trainable=trainable))
    with jax.set_mesh(mesh):
      seconds.append(best_time(lambda: grads(params, placed, reference),
                               ARGS.reps))
  return seconds[0], seconds[1]


# --- grpo_step ----------------------------------------------------------------

GRPO_PROMPTS = (
    "Tell me about your favourite season and why.",
    "I adopted a beagle named Rex last week. Any tips?",
    "Summarise what a memory manager for a chat assistant does.",
    "Plan a three-day trip to Lisbon for a vegetarian.",
    "Explain gradient descent to a ten-year-old.",
    "What should I cook tonight with rice, eggs and spinach?",
    "Write a short poem about the sea.",
    "How do I keep a houseplant alive in winter?")


def shared_reward(text: str) -> float:
  """The reward both sides score with: distinct words per possible word
  (cheap, and it differs within a group; a token spells at most a word)."""
  return min(len(set(text.lower().split())), ARGS.new_tokens) / ARGS.new_tokens


def _grpo_prompts() -> list[list[dict[str, str]]]:
  prompts = [GRPO_PROMPTS[i % len(GRPO_PROMPTS)] for i in range(ARGS.prompts)]
  return [[{"role": "user", "content": p}] for p in prompts]


# Our prompt buckets: the chat-templated prompts fit the first.
GRPO_BUCKETS = (64, 128, 256)


def _ours_grpo(model, tokenizer) -> dict:
  """Our step: the `rl.GRPOStep` object `train` runs (`ChatPolicy`
  rollouts with shared-prompt decoding, the shared reward passed in,
  group advantages, the engine's housekeeping, one sharded `Learner`
  update), its rows padded to our prompt bucket as training pads them."""
  from cmimem_jax.parallel import make_mesh
  from cmimem_jax.rl import (GRPOLossConfig, GRPOStep, Learner,
                             OptimizerConfig, RolloutSettings, Scores,
                             TrainStepConfig)
  from cmimem_jax.sampling import ChatPolicy
  mesh = make_mesh("data:-1")
  learner = Learner(model, TrainStepConfig(
      loss=GRPOLossConfig(kl_beta=ARGS.kl_beta, aggregation="token_mean"),
      optimizer=OptimizerConfig(learning_rate=ARGS.learning_rate,
                                grad_clip_norm=1.0),
      temperature=ARGS.temperature, logprob_chunk=ARGS.new_tokens,
      share_prompts=not ARGS.whole_rows), mesh)
  # No EOS: every row generates exactly `new_tokens` (as TRL's
  # min_new_tokens forces), so both sides do the same work.
  policy = ChatPolicy.jax(learner.model, tokenizer, 512, GRPO_BUCKETS, mesh)
  policy.engine.config = dataclasses.replace(policy.engine.config,
                                             eos_ids=())
  step = GRPOStep(learner, policy, RolloutSettings(
      group=ARGS.group, temperature=ARGS.temperature, top_p=ARGS.top_p,
      max_new_tokens=ARGS.new_tokens, logprob_chunk=ARGS.new_tokens))
  prompts = [policy.encode(m) for m in _grpo_prompts()]

  def reward(rollouts) -> Scores:
    return Scores(np.array([shared_reward(t) for t in rollouts.texts]))

  key = jax.random.key(0)
  times = []
  for index in range(ARGS.steps + 1):
    key, sub = jax.random.split(key)
    start = time.perf_counter()
    result = step(prompts, sub, reward)
    total = time.perf_counter() - start
    metrics, out = result.metrics, result.rollouts.output
    if index:  # Step 0 compiles.
      times.append({"rollout_s": metrics["sample_s"],
                    "scoring_s": metrics["reward_s"],
                    "update_s": total - metrics["sample_s"]
                    - metrics["reward_s"], "step_s": total,
                    "tokens": int(out.lengths.sum()),
                    "rows": int(len(out.lengths)),
                    "update_columns": int(out.prompt_tokens.shape[1]
                                          + out.tokens.shape[1]),
                    "prompt_group": int(metrics["prompt_group"])})
  return _median_step(times)


def _median_step(times: list[dict]) -> dict:
  """The step of median total time, with its split."""
  chosen = sorted(times, key=lambda t: t["step_s"])[len(times) // 2]
  return {k: (round(v, 3) if isinstance(v, float) else v)
          for k, v in chosen.items()}


def _trl_grpo(directory: str, tokenizer) -> dict:
  """TRL's `GRPOTrainer`, one generation and one update per step, its
  generation, reward and whole-step times taken around its own methods."""
  import datasets
  import transformers
  import trl
  times, current = [], {}

  def timed(fn, name):
    def wrapper(*args, **kwargs):
      start = time.perf_counter()
      out = fn(*args, **kwargs)
      current[name] = current.get(name, 0.0) + time.perf_counter() - start
      return out
    return wrapper

  def reward(completions, completion_ids, **kwargs):
    del kwargs
    current["tokens"] = sum(len(ids) for ids in completion_ids)
    current["rows"] = len(completion_ids)
    return [shared_reward(c[0]["content"] if isinstance(c, list) else c)
            for c in completions]

  class StepTimer(transformers.TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
      current.clear()
      current["start"] = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
      total = time.perf_counter() - current.pop("start")
      times.append({"rollout_s": current["rollout_s"],
                    "scoring_s": current["scoring_s"],
                    "update_s": total - current["rollout_s"]
                    - current["scoring_s"], "step_s": total,
                    "tokens": current["tokens"], "rows": current["rows"]})

  rows = ARGS.prompts * ARGS.group
  config = trl.GRPOConfig(
      output_dir=os.path.join(directory, "trl"), report_to="none",
      use_cpu=True, bf16=False, fp16=False, seed=0,
      per_device_train_batch_size=rows, gradient_accumulation_steps=1,
      num_generations=ARGS.group, steps_per_generation=1, num_iterations=1,
      max_completion_length=ARGS.new_tokens,
      generation_kwargs={"min_new_tokens": ARGS.new_tokens},
      temperature=ARGS.temperature, top_p=ARGS.top_p, top_k=0,
      beta=ARGS.kl_beta, epsilon=0.2, loss_type="dapo",
      scale_rewards="group", learning_rate=ARGS.learning_rate,
      lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
      adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1.0,
      max_steps=ARGS.steps + 1, logging_strategy="no", save_strategy="no",
      disable_tqdm=True, dataloader_num_workers=0, shuffle_dataset=False)
  dataset = datasets.Dataset.from_dict(
      {"prompt": _grpo_prompts() * (ARGS.steps + 1)})
  model = transformers.AutoModelForCausalLM.from_pretrained(
      directory, torch_dtype=torch.float32)
  trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=config,
                            train_dataset=dataset, processing_class=tokenizer,
                            callbacks=[StepTimer()])
  # Its end-of-training summary dict would land among our JSON lines.
  trainer.remove_callback(transformers.PrinterCallback)
  trainer._generate = timed(trainer._generate, "rollout_s")
  trainer._calculate_rewards = timed(trainer._calculate_rewards, "scoring_s")
  trainer.train()
  return _median_step(times[1:])  # Step 1 warms up.


def _tunix_grpo(directory: str, tokenizer, model) -> dict:
  """Tunix's `GRPOLearner` on its own Llama port (SmolLM2 is a Llama with
  tied embeddings), loaded from the same safetensors; actor, reference and
  vanilla rollout on one mesh, one generation and one update per step.
  Its generation, reward and update are timed around its own methods;
  its logits on the first prompt are checked against ours
  (`max_abs_logit_diff`)."""
  import copy

  import optax
  from flax import nnx
  from tunix.models.llama3 import model as tunix_llama
  from tunix.models.llama3 import params as tunix_params
  from tunix.rl import rl_cluster as cluster_lib
  from tunix.rl.grpo import grpo_learner
  from tunix.rl.rollout import base_rollout
  times, current = [], {}

  # Tunix ends a completion at the tokenizer's EOS (and masks from it on);
  # the other sides generate exactly `new_tokens` tokens, so its EOS is a
  # token the model does not produce here (`<|endoftext|>`).
  peer_tokenizer = copy.deepcopy(tokenizer)
  peer_tokenizer.eos_token = peer_tokenizer.pad_token = (
      peer_tokenizer.convert_ids_to_tokens(0))
  config = model.config
  llama = tunix_llama.ModelConfig(
      num_layers=config.num_hidden_layers, vocab_size=config.vocab_size,
      embed_dim=config.hidden_size, hidden_dim=config.intermediate_size,
      num_heads=config.num_attention_heads, head_dim=config.head_dim,
      num_kv_heads=config.num_key_value_heads,
      rope_theta=int(config.rope_theta), norm_eps=config.rms_norm_eps,
      weight_tying=config.tie_word_embeddings)
  # Tunix 0.1.7's Llama attention calls `apply_rope` without the config's
  # rope_theta, so its default (1e6) applied instead of SmolLM2's 1e5
  # (logits 1.05 off transformers'; the work is the same either way).
  tunix_llama.apply_rope = functools.partial(
      tunix_llama.apply_rope, rope_theta=int(config.rope_theta))
  # Auto axes: Tunix's models predate explicit-sharding meshes.
  mesh = jax.make_mesh((len(jax.devices()), 1), ("fsdp", "tp"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  load = lambda: tunix_params.create_model_from_safe_tensors(  # noqa: E731
      directory, llama, mesh, dtype=jnp.float32)
  actor, reference = load(), load()
  prompts = [tokenizer.apply_chat_template(m, tokenize=False,
                                           add_generation_prompt=True)
             for m in _grpo_prompts()]
  longest = max(len(tokenizer.encode(p)) for p in prompts)
  # As ours: padded to our prompt bucket.
  prompt_columns = next(b for b in GRPO_BUCKETS if b >= longest)
  tokens = jnp.asarray([tokenizer.encode(prompts[0])], jnp.int32)
  length = tokens.shape[1]
  peer_logits, _ = actor(tokens, jnp.arange(length)[None], None,
                         jnp.tril(jnp.ones((1, length, length), bool)))
  logit_diff = float(jnp.max(jnp.abs(peer_logits - nnx_jit_forward()(
      model, tokens, jnp.ones_like(tokens)))))
  rollout = base_rollout.RolloutConfig(
      max_tokens_to_generate=ARGS.new_tokens,
      max_prompt_length=prompt_columns,
      kv_cache_size=prompt_columns + ARGS.new_tokens + 8,
      temperature=ARGS.temperature, top_p=ARGS.top_p, top_k=None,
      data_type=jnp.float32)
  optimizer = optax.chain(
      optax.clip_by_global_norm(1.0),
      optax.adamw(ARGS.learning_rate, b1=0.9, b2=0.999, eps=1e-8,
                  weight_decay=0.0))
  roles = {role: mesh for role in (cluster_lib.Role.ACTOR,
                                   cluster_lib.Role.REFERENCE,
                                   cluster_lib.Role.ROLLOUT)}
  cluster = cluster_lib.RLCluster(
      actor=actor, reference=reference, tokenizer=peer_tokenizer,
      cluster_config=cluster_lib.ClusterConfig(
          role_to_mesh=roles, rollout_engine="vanilla",
          training_config=cluster_lib.RLTrainingConfig(
              actor_optimizer=optimizer, eval_every_n_steps=10**9,
              max_steps=ARGS.steps + 1),
          rollout_config=rollout))

  def reward(prompts, completions, **kwargs):
    del prompts, kwargs
    return [shared_reward(c) for c in completions]

  learner = grpo_learner.GRPOLearner(
      rl_cluster=cluster, reward_fns=reward,
      algo_config=grpo_learner.GRPOConfig(
          num_generations=ARGS.group, num_iterations=1, beta=ARGS.kl_beta,
          kl_loss_mode="low_var_kl", epsilon=0.2,
          loss_agg_mode="token-mean"))

  generate, rewards, update = (cluster.generate, learner._compute_rewards,
                               cluster.update_actor)

  def timed_generate(*args, **kwargs):
    current.clear()
    current["start"] = time.perf_counter()
    out = generate(*args, **kwargs)
    current["rollout_s"] = time.perf_counter() - current["start"]
    current["tokens"] = sum(len(t) for t in out.tokens)
    current["rows"] = len(out.tokens)
    return out

  def timed_rewards(*args, **kwargs):
    start = time.perf_counter()
    out = rewards(*args, **kwargs)
    current["scoring_s"] = time.perf_counter() - start
    return out

  def timed_update(*args, **kwargs):
    out = update(*args, **kwargs)
    jax.block_until_ready(nnx.state(cluster.actor_trainer.model))
    total = time.perf_counter() - current["start"]
    times.append({"rollout_s": current["rollout_s"],
                  "scoring_s": current["scoring_s"],
                  "update_s": total - current["rollout_s"]
                  - current["scoring_s"], "step_s": total,
                  "tokens": current["tokens"], "rows": current["rows"],
                  "update_columns": prompt_columns + ARGS.new_tokens})
    return out

  cluster.generate, learner._compute_rewards = timed_generate, timed_rewards
  cluster.update_actor = timed_update
  # One array leaf per batch: Tunix repeats every leaf G times.
  learner.train([{"prompts": np.array(prompts)}
                 for _ in range(ARGS.steps + 1)])
  return {**_median_step(times[1:]),  # Step 1 compiles.
          "max_abs_logit_diff": logit_diff}


GRPO_PEERS = ("trl", "tunix")


def run_grpo_step() -> None:
  import tempfile

  peers = [p for p in ARGS.peers.split(",") if p]
  unknown = sorted(set(peers) - set(GRPO_PEERS))
  if unknown or not peers:
    raise SystemExit(f"--peers: choose from {', '.join(GRPO_PEERS)}, "
                     f"got {ARGS.peers!r}")
  if "tunix" in peers:
    try:
      import tunix  # noqa: F401
    except ImportError:
      raise SystemExit("--peers=tunix needs google-tunix importable: "
                       "`make tunix-peer`, then run with PYTHONPATH=.tunix "
                       "(BENCHMARKS.md, 'Second peer: Tunix')") from None

  from cmimem_jax.models.qwen3 import load_gguf
  from cmimem_jax.models.qwen3.params import smollm2_gguf_path, save_hf
  from cmimem_jax.sampling import load_tokenizer
  torch.set_num_threads(os.cpu_count() or 1)
  transformers_logging()
  tokenizer = load_tokenizer("")
  if tokenizer.pad_token is None:
    tokenizer.pad_token = tokenizer.eos_token
  model = load_gguf(smollm2_gguf_path(), **(
      {"num_hidden_layers": ARGS.layers} if ARGS.layers else {}))
  results = {}
  with tempfile.TemporaryDirectory() as directory:
    # The same float32 weights on every side: ours, saved for the peers.
    save_hf(model, directory)
    tokenizer.save_pretrained(directory)
    if "trl" in peers:
      results["trl"] = _trl_grpo(directory, tokenizer)
    if "tunix" in peers:
      results["tunix"] = _tunix_grpo(directory, tokenizer, model)
    ours = _ours_grpo(model, tokenizer)
  line = {
      "scenario": "grpo_step", "model": "smollm2_135m",
      "layers": model.config.num_hidden_layers,
      "prompts": ARGS.prompts, "group": ARGS.group,
      "new_tokens": ARGS.new_tokens, "kl_beta": ARGS.kl_beta,
      "whole_rows": ARGS.whole_rows, "devices": len(jax.devices()),
      "torch_threads": torch.get_num_threads()}
  for name, peer in results.items():
    line.update({
        f"vs_{name}": round(peer["step_s"] / ours["step_s"], 2),
        f"rollout_vs_{name}": round(peer["rollout_s"] / ours["rollout_s"], 2),
        f"update_vs_{name}": round(peer["update_s"] / ours["update_s"], 2),
        f"same_work_{name}": (ours["tokens"], ours["rows"]) == (
            peer["tokens"], peer["rows"])})
  line.update({"ours": ours, **results})
  print(json.dumps(line), flush=True)


def run_offsets() -> None:
  """`token_char_offsets` against `prefix_char_offsets` on one response."""
  from cmimem_jax.sampling import ChatPolicy, load_tokenizer
  from cmimem_jax.task.episode import prefix_char_offsets, token_char_offsets
  policy = ChatPolicy.__new__(ChatPolicy)  # Its decoding needs no model.
  policy.tokenizer = load_tokenizer("")
  line = ("EPISODIC:ADD|2023-05-08: café with Zoë 😀, naïve 北京\n"
          "SEMANTIC:ADD|Rex - Pet: a 3-year-old beagle\n")
  tokens = policy.tokenizer.encode(line * (1 + ARGS.tokens // 20),
                                   add_special_tokens=False)[:ARGS.tokens]
  ours = token_char_offsets(policy.decode, tokens, policy.decode_each)
  start = time.perf_counter()
  peer = prefix_char_offsets(policy.decode, tokens)
  peer_s = time.perf_counter() - start  # One run: seconds per run.
  if ours != peer:
    raise SystemExit("error: the offsets differ from prefix decoding")
  ours_s = best_time(lambda: token_char_offsets(
      policy.decode, tokens, policy.decode_each), ARGS.reps)
  print(json.dumps({"case": "offsets", "tokens": len(tokens),
                    "ours_s": round(ours_s, 5),
                    "prefix_decoding_s": round(peer_s, 3),
                    "speedup": round(peer_s / ours_s, 1)}), flush=True)


def transformers_logging() -> None:
  """Quiet the peer's INFO / progress output."""
  import transformers
  transformers.logging.set_verbosity_error()
  os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main(argv: list[str]) -> None:
  ARGS.__dict__.update(vars(scenario_settings(argv)))
  # Before the first computation: one XLA CPU device per core (the backend
  # reads XLA_FLAGS as it starts).
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "")
      + f" --xla_force_host_platform_device_count={ARGS.devices}")
  {"cmi": run_cmi, "forward": run_forward, "generate": run_generate,
   "train_step": run_train_step, "grpo_step": run_grpo_step,
   "offsets": run_offsets}[ARGS.command]()


if __name__ == "__main__":
  # Compile times are reported: never loaded from a cache.
  run_command(main, flag_values=FLAGS, compilation_cache=False,
              positional=True)
