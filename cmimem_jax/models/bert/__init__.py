"""BERT-family sentence encoder in Flax NNX."""

from cmimem_jax.models.bert.model import Bert, BertConfig, mean_pool
from cmimem_jax.models.bert.params import load_bert

__all__ = ["Bert", "BertConfig", "load_bert", "mean_pool"]
