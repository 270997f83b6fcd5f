"""Compiles the GRPO train step with shared prompts (`rl.share_prompts`:
each prompt packed with its rows through the splash kernel,
`Qwen3.shared_prompt_hidden_states`) for a TPU slice from abstract shapes,
and prints its per-chip memory: one micro-batch of `--rows` rows whose
groups of `--group` share a `--prompt`-token prompt, each row with a
`--completion`-token response.

  python -m tools.compile_shared_prompt --preset=qwen3_4b --rows=32 \
      --prompt=20000 --completion=6000 --group=8

The defaults are `configs/paper.py`'s micro-batch on a v5p-8 (4 sessions
x 8 rollouts, one packed session per chip), bf16 compute, full remat and
the KL reference, as `configs/qwen3_4b_tpu.py` trains.
"""

from __future__ import annotations

import json
import os
import sys
import time

from absl import app, flags

from cmimem_jax.config import run_command

GIB = 2.0 ** 30
# v5p: one device per chip (megacore), as tools/plan.py's TOPOLOGIES.
TOPOLOGIES = {"v5p-8": "v5:2x2x1", "v5p-16": "v5:2x2x2"}

# This tool's flags (its own: tools share flag names).
FLAGS = flags.FlagValues()
flags.DEFINE_string("preset", "qwen3_4b", "The architecture.",
                    flag_values=FLAGS)
flags.DEFINE_integer("layers", 0, "Override the layer count (0: the "
                     "preset's).", flag_values=FLAGS)
flags.DEFINE_enum("topology", "v5p-8", sorted(TOPOLOGIES), "The TPU slice.",
                  flag_values=FLAGS)
flags.DEFINE_integer("rows", 32, "Rows of the micro-batch.",
                     flag_values=FLAGS)
flags.DEFINE_integer("prompt", 20000, "Tokens of each shared prompt.",
                     flag_values=FLAGS)
flags.DEFINE_integer("completion", 6000, "Tokens of each row's response.",
                     flag_values=FLAGS)
flags.DEFINE_integer("group", 8, "Rows per shared prompt.",
                     flag_values=FLAGS)


def main(argv: list[str]) -> dict:
  del argv
  args = FLAGS
  if args.rows % args.group:
    raise app.UsageError(f"--rows={args.rows} is not whole groups of "
                         f"{args.group}")
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx
  from jax.experimental import topologies
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  from cmimem_jax.models.qwen3 import preset
  from cmimem_jax.models.qwen3.params import abstract_model
  from cmimem_jax.parallel import (BATCH_AXES, optimizer_shardings,
                                   param_shardings)
  from cmimem_jax.parallel.mesh import AXES
  from cmimem_jax.rl.losses import GRPOLossConfig
  from cmimem_jax.rl.trainer import (OptimizerConfig, TrainStepConfig,
                                     jit_train_step, make_optimizer)

  try:
    devices = topologies.get_topology_desc(
        platform="tpu", topology_name=TOPOLOGIES[args.topology],
        chip_config_name="megacore").devices
  except Exception as e:  # No libtpu.
    sys.exit(f"error: cannot describe {args.topology} ({e}); is the TPU "
             "extra installed?")
  mesh = Mesh(np.array(devices).reshape(1, len(devices), 1), AXES)
  model_config = preset(
      args.preset, dtype="bfloat16", param_dtype="float32", remat="full",
      attention_impl="auto",
      **({"num_hidden_layers": args.layers} if args.layers else {}))
  graphdef, state = nnx.split(abstract_model(model_config), nnx.Param)
  params = nnx.to_pure_dict(state)
  p_shardings = param_shardings(params, mesh)

  def abstract(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=s), tree, shardings)

  def spec(dtype, *dims):
    return jax.ShapeDtypeStruct(dims, dtype, sharding=NamedSharding(
        mesh, P(BATCH_AXES, *([None] * (len(dims) - 1)))))

  step_config = TrainStepConfig(
      loss=GRPOLossConfig(0.2, 0.2, 0.02),
      optimizer=OptimizerConfig(learning_rate=1e-6), micro_batches=1,
      temperature=1.0, logprob_chunk=1024, share_prompts=True)
  optimizer = make_optimizer(step_config.optimizer)
  o_shardings = optimizer_shardings(optimizer, params, p_shardings, mesh)
  length = args.prompt + args.completion
  batch = {key: spec(jnp.int32, args.rows, length)
           for key in ("tokens", "mask", "loss_mask")}
  batch.update(old_logprobs=spec(jnp.float32, args.rows, length),
               advantages=spec(jnp.float32, args.rows),
               token_weights=spec(jnp.float32, args.rows, length))
  a_params = abstract(params, p_shardings)
  step = jit_train_step(graphdef, step_config, mesh, optimizer, p_shardings,
                        o_shardings, with_reference=True)
  start = time.perf_counter()
  with jax.set_mesh(mesh):
    compiled = step.lower(
        args.prompt, args.group, a_params,
        abstract(jax.eval_shape(optimizer.init, params), o_shardings), batch,
        a_params, None).compile()
  memory = compiled.memory_analysis()
  total = (memory.argument_size_in_bytes + memory.temp_size_in_bytes
           + memory.output_size_in_bytes - memory.alias_size_in_bytes)
  row = {"topology": args.topology, "preset": args.preset,
         "layers": model_config.num_hidden_layers, "rows": args.rows,
         "prompt": args.prompt, "completion": args.completion,
         "group": args.group, "packed_tokens_per_chip": (
             -(-args.rows // args.group // len(devices))
             * (args.prompt + args.group * args.completion)),
         "temporaries_gib": round(memory.temp_size_in_bytes / GIB, 3),
         "total_gib": round(total / GIB, 3),
         # The Pallas kernels, lowered for the TPU (not interpreted).
         "tpu_kernels": compiled.as_text().count("tpu_custom_call"),
         "compile_s": round(time.perf_counter() - start, 1)}
  print(json.dumps(row), flush=True)
  return row


if __name__ == "__main__":
  # Its compile time is measured: never loaded from a cache.
  run_command(main, flag_values=FLAGS, compilation_cache=False)
