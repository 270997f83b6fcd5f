"""The paper's original setup (Table 7) on 8 x H20-96GB GPUs with vLLM
rollouts: Qwen3-4B-Instruct-2507 policy, Qwen3-Embedding served by vLLM
(`encoder.kind = "openai"`), LLM answer model and judge via endpoints.

  python -m cmimem_jax.train --config=configs/qwen3_4b_h20_vllm.py --workdir=DIR \
      --config.policy.path=/ckpt/Qwen3-4B-Instruct-2507 \
      --config.dataset.path=/data/longmemeval_rl_split_qa.json \
      --config.encoder.endpoint.base_url=http://127.0.0.1:8001/v1 \
      --config.qa.answer.base_url=... --config.qa.judge_endpoint.base_url=...
"""

from configs import qwen3_4b_tpu, tiny


def get_config():
  config = qwen3_4b_tpu.get_config()
  config.mesh = "fsdp:8"                     # 8 x H20-96GB.
  config.encoder.update({
      "kind": "openai", "dim": 1024, "path": "",
      "query_prefix": ("Instruct: Given a web search query, retrieve "
                       "relevant passages that answer the query\nQuery:"),
      "endpoint": tiny.endpoint("Qwen/Qwen3-Embedding-0.6B")})
  config.rollout.update({
      "engine": "vllm", "num_rollouts": 8,   # N = 8.
      "temperature": 0.8, "top_p": 0.9,
      "max_prompt_tokens": 20000, "max_new_tokens": 6000})
  config.rollout.vllm = {"tensor_parallel_size": 1,
                         "gpu_memory_utilization": 0.35,
                         "max_model_len": 26000, "dtype": "bfloat16"}
  config.rl.update({
      "epochs": 5, "learning_rate": 1e-6, "sessions_per_batch": 32,
      "kl_beta": 0.02, "epsilon_low": 0.2, "epsilon_high": 0.2,
      "micro_batches": 32})
  config.reward.update({
      "alpha": 0.3, "shaping": "gaussian", "mu": 0.35, "sigma": 0.15,
      "lam": 1e-4, "empty_action_value": -0.5,
      "intra_duplicate_weight": 0.3, "cross_duplicate_weight": 0.5,
      "core_specificity_weight": 0.3, "semantic_skip_bonus": 0.1})
  # Residual-projection conditioning set of Table 7: 5 top-similar + 15
  # recent memories.
  config.reward.conditioning.update({"top_k": 5, "n_recent": 15})
  config.qa.update({"judge": "llm", "top_k": 10})
  return config
