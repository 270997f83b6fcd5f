"""A full CMI-Mem training run in about a minute on a CPU (used by tests).

The paper's training config (`configs/paper.py`) with CPU sizes and
stand-ins: a random tiny Qwen3-architecture policy (vocabulary of the
embedded SmolLM2 tokenizer), the hashing test encoder, the bundled
training sample, the offline `context_recall` QA reward, states built by
the policy itself.

  python -m cmimem_jax.train --config=configs/tiny.py --workdir=/tmp/tiny
"""

import ml_collections

from cmimem_jax.config import memory_defaults
from cmimem_jax.data import bundled_path
from configs import paper


def get_config() -> ml_collections.ConfigDict:
  config = paper.training()
  config.mesh = "data:-1"
  config.dataset.update({"path": bundled_path(), "split": ""})
  config.encoder = ml_collections.ConfigDict(
      {"kind": "hashing", "dim": 64, "path": ""})
  # No model compresses the core or summarises merges on the CPU.
  config.memory = memory_defaults()
  config.policy.update({
      "source": "random", "preset": "tiny",
      # "batched": on the tests' 8-device mesh a learner step of the tiny
      # model takes 1.7 s, against 5 s for auto's per-head path (on one
      # device the two are even).
      "attention_impl": "batched",
      "max_position_embeddings": 2048})
  config.rollout.update({
      "num_rollouts": 4, "temperature": 1.0, "top_p": 1.0,
      "max_new_tokens": 24, "max_prompt_tokens": 1024,
      # One prompt bucket: every step reuses one compiled sampler and train
      # step (the tiny model pads cheaply; a real run wants several).
      "buckets": (1024,)})
  config.qa.judge = "context_recall"
  config.rl.update({
      "sessions_per_batch": 3, "epochs": 1, "max_steps": 2,
      "micro_batches": 1, "learning_rate": 1e-3, "logprob_chunk": 256,
      # The learner runs each session's prompt once for its rollouts
      # (exact; `rl.TrainStepConfig.share_prompts`).
      "share_prompts": True,
      "snapshots": "policy", "snapshot_refresh_epochs": 1,
      "weight_decay": 0.0})
  # A 2-core CPU machine's RAM holds the run itself: a save writes 0.25 GB
  # at a time (+0.35 GiB peak RSS for SmolLM2-135M's 1.5 GiB of params and
  # AdamW state, against +1.3 GiB for all at once).
  config.checkpoint.update({"every_steps": 1, "keep": 2, "keep_period": 0,
                            "save_concurrent_gb": 0.25})
  return config
