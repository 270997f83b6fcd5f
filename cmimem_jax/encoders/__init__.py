"""Text encoders behind one `Encoder` interface."""

from cmimem_jax.encoders.base import EncodeKind, Encoder, HashingEncoder

__all__ = ["EncodeKind", "Encoder", "HashingEncoder"]


def make_encoder(config) -> Encoder:
  """Builds the encoder named by an `encoder` config section.

  kinds: "hashing" (dim), "minilm" (the embedded all-MiniLM-L6-v2, or
  `path`), "qwen3_embedding" (`path` to a HF Qwen3-Embedding checkpoint),
  "openai" (an OpenAI-compatible `endpoint` section, `dim`, optional
  `query_prefix`).
  """
  if config.kind == "hashing":
    return HashingEncoder(dim=config.dim)
  if config.kind == "openai":
    from cmimem_jax.encoders.remote import OpenAIEncoder
    from cmimem_jax.client import EndpointConfig
    return OpenAIEncoder(EndpointConfig.from_config(config.endpoint),
                         config.dim, config.get("query_prefix", ""))
  # Neural encoders pull in transformers/flax: import only when asked.
  from cmimem_jax.encoders import neural
  path = config.get("path") or None
  if config.kind == "minilm":
    return neural.MiniLMEncoder(path)
  if config.kind == "qwen3_embedding":
    if not path:
      raise ValueError("encoder.path must point to a Qwen3-Embedding "
                       "checkpoint folder")
    return neural.Qwen3EmbeddingEncoder(path)
  raise ValueError(f"unknown encoder kind {config.kind!r}")


__all__.append("make_encoder")
