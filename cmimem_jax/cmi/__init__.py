"""The CMI reward: the residual-projection kernel and the reward built on it."""

from cmimem_jax.cmi.kernel import residual_cmi, residual_cmi_unchecked

__all__ = ["residual_cmi", "residual_cmi_unchecked"]
