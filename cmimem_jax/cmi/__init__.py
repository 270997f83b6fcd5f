"""The CMI estimator: the residual-projection kernel, App. F conditioning
sets, the banked estimate of a batch of operations on their banks, and the
App. E log-prob estimator. The reward built on it is the task's
(`cmimem_jax.task.reward`).

`from cmimem_jax.cmi import residual_cmi` is the public, standalone kernel.
"""

from cmimem_jax.cmi.banked import banked_rho
from cmimem_jax.cmi.conditioning import ConditioningConfig, conditioning_sets
from cmimem_jax.cmi.estimator import (BankOperations, CMIEstimator,
                                      OperationTexts)
from cmimem_jax.cmi.kernel import residual_cmi, residual_cmi_unchecked
from cmimem_jax.cmi.logprob import PolicyProfileLM, ProfileLM, memory_text

__all__ = [
    "BankOperations", "CMIEstimator", "ConditioningConfig", "OperationTexts",
    "PolicyProfileLM", "ProfileLM", "banked_rho", "conditioning_sets",
    "memory_text", "residual_cmi", "residual_cmi_unchecked",
]
