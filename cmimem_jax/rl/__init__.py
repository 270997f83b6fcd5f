"""GRPO: log-probs, advantages, losses, the sharded train step, checkpoints
and metrics."""

from cmimem_jax.rl.advantages import group_advantages
from cmimem_jax.rl.batch import rollout_batch
from cmimem_jax.rl.checkpoint import Checkpointer, Restored
from cmimem_jax.rl.logprobs import token_logprobs
from cmimem_jax.rl.losses import GRPOLossConfig, grpo_loss, k3_kl
from cmimem_jax.rl.metrics import MetricsWriter, read_metrics
from cmimem_jax.rl.trainer import (BATCH_KEYS, GRPOTrainer, OptimizerConfig,
                                   TrainStepConfig, accumulated_grads,
                                   make_optimizer)

__all__ = [
    "BATCH_KEYS", "Checkpointer", "GRPOLossConfig", "GRPOTrainer",
    "MetricsWriter", "accumulated_grads", "OptimizerConfig", "Restored", "TrainStepConfig",
    "group_advantages", "grpo_loss", "k3_kl", "make_optimizer",
    "read_metrics", "rollout_batch", "token_logprobs",
]
