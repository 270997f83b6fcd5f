"""Ahead-of-time memory/FLOP plan of the real train step on a device mesh.

  python tools/plan.py --config=configs/qwen3_4b_tpu.py --mesh=fsdp:8,tensor:1 \
      [--batch=8 --length=4096] [--budgets=16,32,95]

Fakes as many CPU devices as the mesh needs, builds the policy's train step
from abstract shapes only (no weights are read or allocated), compiles it
with XLA and prints one JSON line per (batch, length) with XLA's own
per-device memory analysis (arguments, temporaries, outputs) and its FLOP
count, then, per length, the largest per-device micro-batch that fits each
per-device budget (GiB), from a linear fit of the two compiled batch sizes
(memory is affine in the batch: weights + optimizer state + per-row
activations). Compiled for CPU: the TPU/GPU backends lay memory out
differently, so read the numbers as a plan, not a guarantee.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def _args(argv):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--config", required=True)
  parser.add_argument("--mesh", default="fsdp:8,tensor:1")
  parser.add_argument("--batch", default="",
                      help="per-device rows, comma separated (default: 1,2)")
  parser.add_argument("--length", default="4096",
                      help="prompt + completion tokens, comma separated")
  parser.add_argument("--completion", type=int, default=0,
                      help="completion tokens (default: a quarter)")
  parser.add_argument("--budgets", default="16,32,95")
  parser.add_argument("--layers", type=int, default=0,
                      help="override the layer count (smoke tests)")
  return parser.parse_args(argv)


def _load_config(path: str):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(path))))
  spec = importlib.util.spec_from_file_location("plan_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def main(argv=None) -> list[dict]:
  args = _args(argv)
  from cmimem_jax.parallel.mesh import parse_mesh_shape
  shape = parse_mesh_shape(args.mesh)
  if -1 in shape.values():
    raise SystemExit("--mesh needs explicit sizes (no -1)")
  devices = math.prod(shape.values())
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={devices}")
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P

  from cmimem_jax.models.qwen3 import preset
  from cmimem_jax.models.qwen3.params import abstract_model
  from cmimem_jax.parallel import (BATCH_AXES, make_mesh,
                                   optimizer_shardings, param_shardings)
  from cmimem_jax.rl.losses import GRPOLossConfig
  from cmimem_jax.rl.trainer import (OptimizerConfig, TrainStepConfig,
                                     jit_train_step, make_optimizer)
  from flax import nnx

  config = _load_config(args.config)
  policy = config.policy
  overrides = dict(dtype=policy.dtype, param_dtype=policy.param_dtype,
                   remat=policy.remat)
  if args.layers:
    overrides["num_hidden_layers"] = args.layers
  model_config = preset(policy.preset, **overrides)
  mesh = make_mesh(shape)
  graphdef, state = nnx.split(abstract_model(model_config), nnx.Param)
  params = nnx.to_pure_dict(state)
  p_shardings = param_shardings(params, mesh)
  rl = config.rl
  step_config = TrainStepConfig(
      loss=GRPOLossConfig(rl.epsilon_low, rl.epsilon_high, rl.kl_beta),
      optimizer=OptimizerConfig(learning_rate=rl.learning_rate),
      micro_batches=1, temperature=config.rollout.temperature,
      logprob_chunk=rl.logprob_chunk)
  optimizer = make_optimizer(step_config.optimizer)
  o_shardings = optimizer_shardings(optimizer, params, p_shardings, mesh)
  with_ref = rl.kl_beta > 0
  step = jit_train_step(graphdef, step_config, mesh, optimizer, p_shardings,
                        o_shardings, with_reference=with_ref)
  abstract = lambda tree, shardings: jax.tree.map(  # noqa: E731
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree,
      shardings)
  a_params = abstract(params, p_shardings)
  a_opt = abstract(jax.eval_shape(optimizer.init, params), o_shardings)
  shards = math.prod(mesh.shape[a] for a in BATCH_AXES)
  gib = 2.0 ** 30
  rows = []
  for length in (int(x) for x in args.length.split(",")):
    completion = args.completion or length // 4
    fits = {}
    per_device_batches = [int(b) for b in (args.batch or "1,2").split(",")]
    points = []
    for per_device in per_device_batches:
      batch = per_device * shards
      spec = lambda *dims: jax.ShapeDtypeStruct(  # noqa: E731
          dims[1:], dims[0], sharding=NamedSharding(
              mesh, P(BATCH_AXES, *([None] * (len(dims) - 2)))))
      a_batch = {"tokens": spec(jnp.int32, batch, length),
                 "mask": spec(jnp.int32, batch, length),
                 "loss_mask": spec(jnp.int32, batch, length),
                 "old_logprobs": spec(jnp.float32, batch, length),
                 "advantages": spec(jnp.float32, batch),
                 "token_weights": spec(jnp.float32, batch, length)}
      start = time.perf_counter()
      compiled = step.lower(length - completion, a_params, a_opt, a_batch,
                            a_params if with_ref else None, None).compile()
      compile_s = time.perf_counter() - start
      memory = compiled.memory_analysis()
      cost = compiled.cost_analysis()
      cost = cost[0] if isinstance(cost, list) else cost
      total = (memory.argument_size_in_bytes + memory.temp_size_in_bytes
               + memory.output_size_in_bytes - memory.alias_size_in_bytes)
      points.append((per_device, total))
      row = {
          "mesh": dict(mesh.shape), "devices": devices,
          "layers": model_config.num_hidden_layers,
          "global_batch": batch, "per_device_batch": per_device,
          "length": length, "completion": completion,
          "arguments_gib": round(memory.argument_size_in_bytes / gib, 3),
          "temporaries_gib": round(memory.temp_size_in_bytes / gib, 3),
          "outputs_gib": round(memory.output_size_in_bytes / gib, 3),
          "aliased_gib": round(memory.alias_size_in_bytes / gib, 3),
          "per_device_total_gib": round(total / gib, 3),
          "tflops_per_device_step": round(cost.get("flops", 0.0) / 1e12, 2),
          "compile_s": round(compile_s, 1)}
      rows.append(row)
      print(json.dumps(row), flush=True)
    if len(points) >= 2:
      (b0, m0), (b1, m1) = points[0], points[-1]
      per_row = (m1 - m0) / (b1 - b0)
      fixed = m0 - per_row * b0
      for budget in (float(x) for x in args.budgets.split(",")):
        fits[f"{budget:g}GiB"] = (max(0, int((budget * gib - fixed) // per_row))
                                  if per_row > 0 else None)
      summary = {"mesh": dict(mesh.shape), "length": length,
                 "fixed_gib": round(fixed / gib, 3),
                 "per_row_gib": round(per_row / gib, 3),
                 "max_per_device_batch": fits}
      rows.append(summary)
      print(json.dumps(summary), flush=True)
  return rows


if __name__ == "__main__":
  main()
