"""The paper's setting (`qwen3_4b.py`, Table 7) on a TPU slice: JAX rollouts,
the Qwen3-Embedding encoder in process, bf16 compute with full remat, the
Pallas splash-attention kernel (`policy.attention_impl="auto"` on TPU).

  pip install -e ".[gcs]"   # gs:// workdirs (gcsfs)
  python -m cmimem_jax.train --config=configs/qwen3_4b_tpu.py --workdir=gs://... \
      --config.policy.path=/ckpt/Qwen3-4B-Instruct-2507 \
      --config.encoder.path=/ckpt/Qwen3-Embedding-0.6B \
      --config.dataset.path=/data/longmemeval_rl_split_qa.json \
      --config.rl.snapshots=/data/expert_states \
      --config.reward.skip_calibration=/data/skip_calibration.json \
      --config.qa.answer.base_url=... --config.qa.judge_endpoint.base_url=...

(`tools/build_expert_states.py` builds `/data/expert_states`,
`tools/skip_calibration.py` the encoder's Semantic SKIP thresholds in
`/data/skip_calibration.json`: without them the run refuses to start;
`tools/rehearse.py` runs this command on a CPU with sizes, paths and
endpoints changed, its workdir, dataset and expert states in a bucket of
a GCS emulator. A preempted VM's successor resumes with the same command.)

Table 7's settings on a v5p-8, proven by compiling the trainer's own
programs (`tools/plan.py` lowers the step `task.loop.grpo_step` builds,
over abstract weights; BENCHMARKS.md, "Current" and "The paper's run,
costed"):

  pip install -e ".[tpu]"
  python -m tools.plan --config=configs/qwen3_4b_tpu.py --topology=v5p-8 --run

* the update of a whole step (prompts up to 20,000 tokens, responses up
  to 6,000, 32 sessions x 8 rollouts in 8 micro-batches, each session's
  prompt run once for its rollouts: `rl.share_prompts`) needs 72.8 GiB of
  the 95 GiB HBM per chip; a v6e-8 (32 GiB) does not hold it (40.6 GiB);
* rollouts decode on every chip (`rollout.decode_devices="mesh"`), each
  holding its share of the rows and of both KV caches (a session's 20k
  prompt cache is shared by its 8 rollouts), in waves of 64 rows
  (`max_rows_per_wave`): 2 sessions per chip, 43.2 GiB with the optimizer
  state and reference that stay resident;
* the in-process Qwen3-Embedding's largest call, 23.4 GiB beside them.
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
