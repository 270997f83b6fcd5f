"""Text encoders behind one `Encoder` interface."""

from cmimem_jax.encoders.base import EncodeKind, Encoder, HashingEncoder

__all__ = ["EncodeKind", "Encoder", "HashingEncoder"]


def make_encoder(config) -> Encoder:
  """Builds the encoder named by an `encoder` config section."""
  if config.kind == "hashing":
    return HashingEncoder(dim=config.dim)
  raise ValueError(f"unknown encoder kind {config.kind!r}")


__all__.append("make_encoder")
