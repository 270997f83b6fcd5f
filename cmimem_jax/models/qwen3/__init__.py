"""Qwen3 (and Llama-family) decoder in Flax NNX with HF/GGUF checkpoint I/O."""

from cmimem_jax.models.qwen3.model import (PRESETS, KVCache, Qwen3,
                                           Qwen3Config, positions_from_mask,
                                           preset)
from cmimem_jax.models.qwen3.params import (load_gguf, load_gguf_tokenizer,
                                            load_hf, save_hf)

__all__ = [
    "KVCache", "PRESETS", "Qwen3", "Qwen3Config", "load_gguf",
    "load_gguf_tokenizer", "load_hf", "positions_from_mask", "preset",
    "save_hf",
]
