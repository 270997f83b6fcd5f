"""A full CMI-Mem training run in about a minute on a CPU (used by tests).

A random tiny Qwen3-architecture policy (vocabulary of the embedded SmolLM2
tokenizer), the hashing test encoder, the bundled training sample.

  python -m cmimem_jax.train --config=configs/tiny.py --workdir=/tmp/tiny
"""

import ml_collections

from cmimem_jax.cmi.reward import reward_defaults
from cmimem_jax.config import memory_defaults
from cmimem_jax.data import bundled_path


def endpoint(model: str = "") -> ml_collections.ConfigDict:
  """An OpenAI-compatible endpoint (`client.EndpointConfig`)."""
  return ml_collections.ConfigDict({
      "base_url": "http://127.0.0.1:8000/v1", "model": model,
      "api_key_env": "OPENAI_API_KEY", "timeout_s": 60.0, "max_retries": 3,
      "backoff_s": 1.0, "max_backoff_s": 30.0, "concurrency": 8,
      "temperature": 0.0, "max_tokens": 256})


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.mesh = "data:-1"  # AXIS:SIZE over data/fsdp/tensor; -1 = the rest.
  config.tensorboard = True
  config.dataset = ml_collections.ConfigDict({
      "name": "longmemeval", "path": bundled_path(), "dialogues": 0,
      # LongMemEval's sft | rl | test partition, or all ("": all).
      "split": ""})
  config.encoder = ml_collections.ConfigDict(
      {"kind": "hashing", "dim": 64, "path": ""})
  config.memory = memory_defaults()
  config.reward = reward_defaults()  # α, μ, σ, λ, penalties (Table 7).
  config.policy = ml_collections.ConfigDict({
      "source": "random",  # random | gguf | hf
      "preset": "tiny", "path": "", "seed": 0,
      "tokenizer": "",     # GGUF file or HF dir; "" = embedded SmolLM2.
      # A training workdir (e.g. `cmimem_jax.sft`'s) whose newest weights
      # replace the loaded ones before GRPO starts ("" = none).
      "init_checkpoint": "",
      "dtype": "float32", "param_dtype": "float32", "remat": "none",
      # models.attention.ATTENTION_IMPLS; "auto": splash on TPU, cuDNN on
      # GPU (bf16), an XLA path on CPU. "batched": on the tests' 8-device
      # mesh a learner step of the tiny model takes 1.7 s, against 5 s for
      # auto's per-head path (on one device the two are even).
      "attention_impl": "batched",
      "max_position_embeddings": 2048})
  config.rollout = ml_collections.ConfigDict({
      "engine": "jax", "num_rollouts": 4, "temperature": 1.0, "top_p": 1.0,
      "max_new_tokens": 24, "max_prompt_tokens": 1024,
      # One prompt bucket: every step reuses one compiled sampler and train
      # step (the tiny model pads cheaply; a real run wants several).
      "buckets": (1024,),
      # JAX engine: decode at most this many rows at once, in whole groups
      # of num_rollouts (0 = the whole batch); bounds the KV cache.
      "max_rows_per_wave": 0,
      # Existing entries per type shown to the policy (Alg. 1 TopK). 0 hides
      # the bank from the policy; it is not the "RM" ablation of Table 3
      # (that is `memory.source_chunks=False`).
      "retrieval_top_k": 20,
      # Grammar-constrained DSL decoding (JAX engine only): for policies too
      # small to follow the format; the paper's 4B runs are unconstrained.
      "constrained_dsl": False})
  config.qa = ml_collections.ConfigDict({
      "judge": "context_recall",  # context_recall | llm
      "top_k": 10, "prompt": "listing11",
      "answer": endpoint(), "judge_endpoint": endpoint()})
  config.rl = ml_collections.ConfigDict({
      "sessions_per_batch": 3, "epochs": 1, "max_steps": 2,
      "micro_batches": 1, "learning_rate": 1e-3, "warmup_steps": 0,
      "weight_decay": 0.0, "grad_clip_norm": 1.0, "kl_beta": 0.02,
      "epsilon_low": 0.2, "epsilon_high": 0.2, "logprob_chunk": 256,
      # token_mean: every completion token of the step weighs the same
      # (verl's default, MemBuilder's run); sequence_mean: per-sequence
      # means averaged (the GRPO paper).
      "loss_aggregation": "token_mean",
      # The learner runs each session's prompt once for its rollouts
      # (exact; `rl.TrainStepConfig.share_prompts`).
      "share_prompts": True,
      # M_{t-1} of each session: "policy" (built by the initial policy,
      # rebuilt by the current one every snapshot_refresh_epochs epochs)
      # or a directory of fixed expert states (the paper's protocol;
      # tools/build_expert_states.py).
      "snapshots": "policy",
      "snapshot_refresh_epochs": 1,
      "curriculum_weights": (1.0, 1.0, 1.0), "curriculum_tiers": 3,
      # Held-out sessions (never trained on) answered greedily and scored
      # every eval_every steps (and at the last): eval/* in metrics.jsonl.
      "validation_sessions": 0, "eval_every": 0})
  # keep: the newest checkpoints; keep_period > 0 also keeps every step
  # divisible by it (checkpoint selection by step, App. I).
  config.checkpoint = ml_collections.ConfigDict(
      {"every_steps": 1, "keep": 2, "keep_period": 0, "async_save": True})
  return config
