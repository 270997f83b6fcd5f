"""Text encoders behind one `Encoder` interface."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from typing import ClassVar

from cmimem_jax.config import EndpointConfig, Section, need, positive_int
from cmimem_jax.encoders.base import (DEFAULT_QUERY_INSTRUCTION, EncodeKind,
                                      Encoder, HashingEncoder,
                                      instructed_query)

__all__ = ["DEFAULT_QUERY_INSTRUCTION", "EncodeKind", "Encoder",
           "HashingEncoder", "instructed_query"]


ENCODERS = ("hashing", "minilm", "qwen3_embedding", "openai")
# The kinds that embed queries with `encoder.query_instruction`; the
# others are symmetric and take none.
INSTRUCTED_ENCODERS = ("qwen3_embedding", "openai")


@dataclasses.dataclass(frozen=True)
class EncoderConfig(Section):
  """The `encoder` section (`make_encoder`)."""

  SECTION: ClassVar[str] = "encoder"

  kind: str                        # One of ENCODERS.
  dim: int | None = None           # hashing / openai: the vector width.
  path: str = ""                   # A local checkpoint ("": the embedded).
  # None: the kind's default (`query_instruction`).
  query_instruction: str | None = None
  endpoint: EndpointConfig | None = None  # openai: the endpoint.

  def invalid(self) -> Iterator[str]:
    yield from need(self, "kind", lambda v: v in ENCODERS,
                    f"one of {ENCODERS}")
    if self.query_instruction and self.kind not in INSTRUCTED_ENCODERS:
      yield (f"query_instruction is set, but encoder.kind={self.kind!r} "
             f"takes no instruction (only {INSTRUCTED_ENCODERS} do)")
    if self.kind in ("hashing", "openai"):
      yield from need(self, "dim", positive_int, "a positive integer")
    elif self.kind == "minilm":
      # all-MiniLM-L6-v2's width: another would index and calibrate a
      # vector size the model never produces.
      yield from need(self, "dim", lambda v: v in (None, 384),
                      "384 (all-MiniLM-L6-v2's width) for "
                      "encoder.kind='minilm'")
    if self.kind == "openai" and self.endpoint is None:
      yield "endpoint: missing (encoder.kind='openai' embeds through it)"
    elif self.kind == "qwen3_embedding":
      yield from need(self, "path", os.path.isdir, "a HF checkpoint folder")


def query_instruction(config: EncoderConfig) -> str:
  """The instruction an `encoder` config section's queries are embedded
  with ("" for the symmetric kinds and an endpoint without one)."""
  instruction = getattr(config, "query_instruction", None)
  if config.kind == "qwen3_embedding" and instruction is None:
    return DEFAULT_QUERY_INSTRUCTION
  return instruction or ""


def encoder_identity(config: EncoderConfig) -> dict:
  """What decides an `encoder` section's vectors, wherever it runs (not
  its path or endpoint): kind, width, query instruction."""
  return {"kind": config.kind, "dim": getattr(config, "dim", None),
          "query_instruction": query_instruction(config)}


def make_encoder(config: EncoderConfig) -> Encoder:
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
    return OpenAIEncoder(config.endpoint,
                         config.dim, instruction)
  # Neural encoders pull in transformers/flax: import only when asked.
  from cmimem_jax.encoders import neural
  path = config.path or None
  if config.kind == "minilm":
    return neural.MiniLMEncoder(path)
  if config.kind == "qwen3_embedding":
    if not path:
      raise ValueError("encoder.path must point to a Qwen3-Embedding "
                       "checkpoint folder")
    return neural.Qwen3EmbeddingEncoder(path, instruction)
  raise ValueError(f"unknown encoder kind {config.kind!r}")


__all__ += ["ENCODERS", "EncoderConfig", "INSTRUCTED_ENCODERS",
            "encoder_identity", "make_encoder", "query_instruction"]
