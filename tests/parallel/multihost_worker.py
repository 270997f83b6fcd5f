"""One process of the multi-host test: joins `jax.distributed` on localhost
(when there are several processes), loads only its own rows of the batch,
takes one sharded GRPO step and prints the replicated results as JSON.

  python multihost_worker.py PROCESS_ID NUM_PROCESSES PORT LOCAL_DEVICES
"""

import json
import os
import sys

process_id, num_processes, port, local_devices = map(int, sys.argv[1:5])
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + f" --xla_force_host_platform_device_count={local_devices}").strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

if num_processes > 1:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  os.environ.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                    JAX_NUM_PROCESSES=str(num_processes),
                    JAX_PROCESS_ID=str(process_id))

from cmimem_jax.parallel import initialize_distributed, make_mesh  # noqa: E402

initialize_distributed()

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from cmimem_jax.models.qwen3 import Qwen3, preset  # noqa: E402
from cmimem_jax.rl import (GRPOLossConfig, Learner,  # noqa: E402
                           OptimizerConfig, TrainStepConfig)

ROWS, LENGTH, VOCAB = 8, 12, 64


def global_batch() -> dict[str, np.ndarray]:
  rng = np.random.default_rng(0)
  loss_mask = np.zeros((ROWS, LENGTH), np.int32)
  loss_mask[:, 6:] = 1
  return {
      "tokens": rng.integers(1, VOCAB, (ROWS, LENGTH)).astype(np.int32),
      "mask": np.ones((ROWS, LENGTH), np.int32), "loss_mask": loss_mask,
      "old_logprobs": (-4.0 * loss_mask).astype(np.float32),
      "advantages": rng.standard_normal(ROWS).astype(np.float32),
      "token_weights": loss_mask.astype(np.float32)}


mesh = make_mesh("fsdp:2,tensor:2")
trainer = Learner(
    Qwen3(preset("tiny", vocab_size=VOCAB), rngs=nnx.Rngs(0)),
    TrainStepConfig(loss=GRPOLossConfig(kl_beta=0.02),
                    optimizer=OptimizerConfig(learning_rate=1e-3)), mesh)
# Per-host loading: this process reads only the rows its devices hold.
rows = ROWS // jax.process_count()
local = {k: v[process_id * rows:(process_id + 1) * rows]
         for k, v in global_batch().items()}
metrics = trainer.step(local)
checksum = jax.jit(lambda p: sum(jnp.sum(x * x) for x in jax.tree.leaves(p)),
                   out_shardings=jax.sharding.NamedSharding(
                       mesh, jax.sharding.PartitionSpec()))(trainer.params)
print(json.dumps({"process": process_id, "devices": jax.device_count(),
                  "loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
                  "kl": metrics["kl"], "param_checksum": float(checksum)}))
