"""The paper's original hardware (Table 7: 8 x H20-96GB) for the setting of
`qwen3_4b.py`: vLLM rollouts, Qwen3-Embedding served by vLLM
(`encoder.kind = "openai"`), LLM answer model and judge via endpoints.

  python -m cmimem_jax.train --config=configs/qwen3_4b_h20_vllm.py --workdir=DIR \
      --config.policy.path=/ckpt/Qwen3-4B-Instruct-2507 \
      --config.dataset.path=/data/longmemeval_rl_split_qa.json \
      --config.encoder.endpoint.base_url=http://127.0.0.1:8001/v1 \
      --config.rl.snapshots=/data/expert_states \
      --config.reward.skip_calibration=/data/skip_calibration.json \
      --config.qa.answer.base_url=... --config.qa.judge_endpoint.base_url=...

The served encoder (`encoder.kind="openai"`) has its own Semantic SKIP
calibration: `python -m tools.skip_calibration
--config=configs/qwen3_4b_h20_vllm.py ...` with the endpoint up writes it.
"""

import ml_collections

from configs import paper, qwen3_4b


def get_config() -> ml_collections.ConfigDict:
  config = qwen3_4b.get_config()
  config.mesh = "fsdp:8"  # 8 x H20-96GB.
  config.encoder.update({
      "kind": "openai", "endpoint": paper.endpoint("Qwen/Qwen3-Embedding-0.6B")})
  # attention_impl "auto" (the paper base): cuDNN flash attention.
  config.policy.update({"dtype": "bfloat16", "param_dtype": "float32",
                        "remat": "full", "attention_impl": "auto"})
  # The paper base's buckets pad the learner's rows (a few compiled train
  # steps); vLLM itself generates from the unpadded prompts.
  config.rollout.engine = "vllm"
  # Whole rows, one per GPU a micro-batch: the shared-prompt update's
  # attention is an XLA [T, Tp + T] score block off TPU (cuDNN takes no
  # shared prefix).
  config.rl.update({"micro_batches": 32, "share_prompts": False})
  config.rollout.vllm = {"tensor_parallel_size": 1,
                         "gpu_memory_utilization": 0.35,
                         "max_model_len": 26000, "dtype": "bfloat16"}
  return config
