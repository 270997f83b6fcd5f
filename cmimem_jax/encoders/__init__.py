"""Text encoders behind one `Encoder` interface."""

from cmimem_jax.encoders.base import (DEFAULT_QUERY_INSTRUCTION, EncodeKind,
                                      Encoder, HashingEncoder,
                                      instructed_query)

__all__ = ["DEFAULT_QUERY_INSTRUCTION", "EncodeKind", "Encoder",
           "HashingEncoder", "instructed_query"]


def query_instruction(config) -> str:
  """The instruction an `encoder` config section's queries are embedded
  with ("" for the symmetric kinds and an endpoint without one)."""
  instruction = config.get("query_instruction")
  if config.kind == "qwen3_embedding" and instruction is None:
    return DEFAULT_QUERY_INSTRUCTION
  return instruction or ""


def encoder_identity(config) -> dict:
  """What decides an `encoder` section's vectors, wherever it runs (not
  its path or endpoint): kind, width, query instruction."""
  return {"kind": config.kind, "dim": config.get("dim"),
          "query_instruction": query_instruction(config)}


def make_encoder(config) -> Encoder:
  """Builds the encoder named by an `encoder` config section.

  kinds: "hashing" (dim), "minilm" (the embedded all-MiniLM-L6-v2, or
  `path`), "qwen3_embedding" (`path` to a HF Qwen3-Embedding checkpoint),
  "openai" (an OpenAI-compatible `endpoint` section, `dim`). The last two
  embed queries with `query_instruction` (default
  `DEFAULT_QUERY_INSTRUCTION` in process, none over an endpoint): one
  value gives the same query text whichever runs it.
  """
  instruction = query_instruction(config)
  if config.kind == "hashing":
    return HashingEncoder(dim=config.dim)
  if config.kind == "openai":
    from cmimem_jax.encoders.remote import OpenAIEncoder
    from cmimem_jax.client import EndpointConfig
    return OpenAIEncoder(EndpointConfig.from_config(config.endpoint),
                         config.dim, instruction)
  # Neural encoders pull in transformers/flax: import only when asked.
  from cmimem_jax.encoders import neural
  path = config.get("path") or None
  if config.kind == "minilm":
    return neural.MiniLMEncoder(path)
  if config.kind == "qwen3_embedding":
    if not path:
      raise ValueError("encoder.path must point to a Qwen3-Embedding "
                       "checkpoint folder")
    return neural.Qwen3EmbeddingEncoder(path, instruction)
  raise ValueError(f"unknown encoder kind {config.kind!r}")


__all__ += ["encoder_identity", "make_encoder", "query_instruction"]
