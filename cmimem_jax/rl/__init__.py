"""The learner, knowing nothing of memories: chunked per-token log-probs,
group advantages, the GRPO and SFT objectives over one sharded, jitted
train step (`Learner`), one whole GRPO step with the reward passed in
(`GRPOStep`), Orbax checkpoints and metrics. Imports only
`models`, `parallel` and `sampling`."""

from cmimem_jax.rl.advantages import group_advantages
from cmimem_jax.rl.batch import (rollout_batch, shared_prompt_group,
                                 supervised_batch)
from cmimem_jax.rl.checkpoint import (CheckpointConfig, Checkpointer, Restored,
                                      load_model_weights)
from cmimem_jax.rl.logprobs import (mean_continuation_logprobs,
                                    recompute_logprobs, token_logprobs)
from cmimem_jax.rl.losses import (AGGREGATIONS, OLD_LOGPROBS, GRPOLossConfig,
                                  Objective,
                                  SFTLossConfig, aggregation_scale, grpo_loss,
                                  k3_kl, sft_loss)
from cmimem_jax.rl.metrics import MetricsWriter, read_metrics, read_rollouts
from cmimem_jax.rl.signals import StopSignals
from cmimem_jax.rl.step import (GRPOStep, IncrementalReward, RewardFn,
                                Rollouts, RolloutSettings, Scores, StepResult,
                                WholeStepReward)
from cmimem_jax.rl.trainer import (Learner, OptimizerConfig, TrainStepConfig,
                                   accumulated_grads, make_optimizer)

__all__ = [
    "AGGREGATIONS", "OLD_LOGPROBS", "aggregation_scale", "CheckpointConfig",
    "Checkpointer",
    "GRPOLossConfig", "GRPOStep", "IncrementalReward", "Learner", "RewardFn",
    "Rollouts",
    "RolloutSettings", "Scores", "StepResult", "MetricsWriter", "Objective",
    "OptimizerConfig", "Restored", "SFTLossConfig", "StopSignals", "TrainStepConfig",
    "accumulated_grads", "group_advantages", "grpo_loss", "k3_kl",
    "load_model_weights", "make_optimizer", "mean_continuation_logprobs",
    "read_metrics", "read_rollouts", "recompute_logprobs", "rollout_batch",
    "shared_prompt_group", "sft_loss", "supervised_batch", "token_logprobs",
    "WholeStepReward",
]
