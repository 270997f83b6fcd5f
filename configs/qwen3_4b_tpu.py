"""The paper's setting (`qwen3_4b.py`, Table 7) on a TPU slice: JAX rollouts,
the Qwen3-Embedding encoder in process, bf16 compute with full remat, the
Pallas splash-attention kernel (`policy.attention_impl="auto"` on TPU).

  python -m cmimem_jax.train --config=configs/qwen3_4b_tpu.py --workdir=gs://... \
      --config.policy.path=/ckpt/Qwen3-4B-Instruct-2507 \
      --config.encoder.path=/ckpt/Qwen3-Embedding-0.6B \
      --config.dataset.path=/data/longmemeval_rl_split_qa.json \
      --config.rl.snapshots=/data/expert_states \
      --config.qa.answer.base_url=... --config.qa.judge_endpoint.base_url=...

(`tools/build_expert_states.py` builds `/data/expert_states`;
`tools/rehearse.py` runs this command on a CPU with sizes, paths and
endpoints changed.)

Table 7 as written (prompts up to 20,000 tokens, responses up to 6,000,
32 sessions x 8 rollouts per step, 32 micro-batches) fits a v5p-8,
proven by the compiled plan (`BENCHMARKS.md`):

  pip install -e ".[tpu]"
  python tools/plan.py --config=configs/qwen3_4b_tpu.py --topology=v5p-8 --batch=1,2

* train step, 26,000 tokens per row: 2 rows per chip (one micro-batch of
  8 rows over 4 chips) need 51.5 GiB of the 95 GiB HBM (5 rows fit);
* rollouts: 8 sessions x 8 rollouts per chip decode over one shared
  20k-token prompt cache per session in 82.4 GiB; decoding in two waves
  (`max_rows_per_wave` = 128 rows = 4 sessions per chip, 43.8 GiB) leaves
  room for the optimizer state that stays resident. The same setting fits
  a v6e-8 (32 GiB: 1 training row and 2 sessions per chip, 26.0 / 21.8 GiB).
"""

import ml_collections

from configs import qwen3_4b


def get_config() -> ml_collections.ConfigDict:
  config = qwen3_4b.get_config()
  config.mesh = "fsdp:-1"  # ZeRO-3 over every chip; e.g. fsdp:4,tensor:2.
  config.encoder.kind = "qwen3_embedding"
  config.policy.update({"dtype": "bfloat16", "param_dtype": "float32",
                        "remat": "full", "attention_impl": "auto"})
  # Rollouts decode on every chip, each holding its share of the rows and
  # KV caches, in waves of 64 rows: a whole group of 8 per chip of a v6e-8
  # (Table 7's 128 do not fit its 32 GiB beside the resident optimizer
  # state: 35.7 GiB; 64: 22.1), 2 per chip of a v5p-8.
  config.rollout.update({"engine": "jax", "max_rows_per_wave": 64,
                         "decode_devices": "mesh"})
  return config
