"""Core compression through a chat model (Listing 5).

When a write pushes the core block over `compress_trigger · cap`, `Apply`
calls a `Compressor`; `ChatCompressor` asks a chat model (the policy, or
an endpoint) with Listing 5 and reads its `{"content": ...}` answer. Any
failure (a failed call, unreadable JSON, an empty or over-cap answer)
raises, `Apply` counts it and falls back to keeping the newest lines.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cmimem_jax.client import ChatModel
from cmimem_jax.memory.apply import CoreConfig
from cmimem_jax.memory.builder import core_config
from cmimem_jax.memory.json_agents import loads_llm_json
from cmimem_jax.memory.prompt_builder import build_compression_prompt


class ChatCompressor:
  """`Compressor` over a `ChatModel`; counts its calls."""

  def __init__(self, model: ChatModel, config: CoreConfig):
    self.model, self.config = model, config
    self.calls = 0

  def __call__(self, core: str) -> str:
    self.calls += 1
    prompt = build_compression_prompt(core, self.config.cap_chars,
                                      self.config.compress_target_chars)
    (result,) = self.model.chat_many([[{"role": "user", "content": prompt}]])
    if not result.ok:
      raise RuntimeError(f"compression call failed: {result.error}")
    content = loads_llm_json(result.text).get("content")
    if not isinstance(content, str) or not content.strip():
      raise ValueError(f"no 'content' in the compression answer: "
                       f"{result.text[:80]!r}")
    return content.strip()


def core_compressor(memory: Any, models: Mapping[str, ChatModel | None]
                    ) -> ChatCompressor | None:
  """The `memory.compressor` of a job over its models (`{"policy": ...,
  "answer": ...}`); None for "none" (the counted newest-lines fallback).

  Raises:
    ValueError: the configured model is not part of this job.
  """
  if memory.compressor == "none":
    return None
  model = models.get(memory.compressor)
  if model is None:
    raise ValueError(f"memory.compressor={memory.compressor!r}, but this job "
                     f"has no {memory.compressor} model (have: "
                     f"{sorted(k for k, v in models.items() if v)})")
  return ChatCompressor(model, core_config(memory))
