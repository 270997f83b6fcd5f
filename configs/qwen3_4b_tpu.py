"""The paper's setting (`qwen3_4b.py`, Table 7) on a TPU mesh: JAX rollouts,
the Qwen3-Embedding encoder in process, bf16 compute with full remat.

  python -m cmimem_jax.train --config=configs/qwen3_4b_tpu.py --workdir=gs://... \
      --config.policy.path=/ckpt/Qwen3-4B-Instruct-2507 \
      --config.encoder.path=/ckpt/Qwen3-Embedding-0.6B \
      --config.dataset.path=/data/longmemeval_rl_split_qa.json \
      --config.qa.answer.base_url=... --config.qa.judge_endpoint.base_url=...

`python tools/plan.py --config=configs/qwen3_4b_tpu.py --mesh=fsdp:8,tensor:1`
compiles this train step ahead of time and reports per-device memory.
"""

import ml_collections

from configs import qwen3_4b


def get_config() -> ml_collections.ConfigDict:
  config = qwen3_4b.get_config()
  config.mesh = "fsdp:-1"  # ZeRO-3 over every chip; e.g. fsdp:4,tensor:2.
  config.encoder.kind = "qwen3_embedding"
  config.policy.update({"dtype": "bfloat16", "param_dtype": "float32",
                        "remat": "full"})
  config.rollout.update({"engine": "jax",
                         "buckets": (4096, 8192, 12288, 16384, 20000)})
  return config
