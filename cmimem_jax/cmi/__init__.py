"""The CMI reward: the residual-projection kernel and the reward built on it.

`from cmimem_jax.cmi import residual_cmi` is the public, standalone kernel.
"""

from cmimem_jax.cmi.banked import banked_rho
from cmimem_jax.cmi.conditioning import ConditioningConfig, conditioning_sets
from cmimem_jax.cmi.kernel import residual_cmi, residual_cmi_unchecked
from cmimem_jax.cmi.logprob import PolicyProfileLM, ProfileLM, memory_text
from cmimem_jax.cmi.reward import (RewardComputer, RewardConfig, RewardTerms,
                                   RolloutInput, gaussian_shaping,
                                   operation_score, reward_defaults,
                                   token_weights)

__all__ = [
    "ConditioningConfig", "PolicyProfileLM", "ProfileLM", "RewardComputer", "RewardConfig", "RewardTerms",
    "RolloutInput", "banked_rho", "conditioning_sets", "gaussian_shaping",
    "memory_text", "operation_score", "residual_cmi", "residual_cmi_unchecked",
    "reward_defaults", "token_weights",
]
