"""Memory rewrites through a chat model: core compression (Listing 5) and
MERGE summaries (Listing 9).

When a write pushes the core block over `compress_trigger · cap`, `Apply`
calls `MemoryEditors.compress_core`; `ChatCompressor` asks a chat model
(the policy, or an endpoint) with Listing 5 and reads its
`{"content": ...}` answer. When the policy MERGEs episodic memories,
`ChatMergeSummarizer` asks the model with Listing 9 for the merged text
(the policy, the answer model or an external endpoint of its own).
Any failure (a failed call, unreadable JSON, an empty or over-cap answer)
raises; `Apply` counts it and falls back (newest core lines; the policy's
own MERGE text).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from cmimem_jax.client import ChatModel, OpenAIClient
from cmimem_jax.memory.apply import CoreConfig, MemoryEditors
from cmimem_jax.memory.builder import MemoryConfig, core_config
from cmimem_jax.memory.json_agents import loads_llm_json
from cmimem_jax.memory.prompt_builder import (build_compression_prompt,
                                              build_merge_prompt)


# Answer budgets (tokens) that fit the listings: Listing 5 asks for a core
# block of up to `compress_target_chars` (3,000) characters inside JSON,
# ~1,000 tokens for English text; a Listing 9 summary is shorter.
DEFAULT_COMPRESS_MAX_TOKENS = 1536
DEFAULT_MERGE_MAX_TOKENS = 1024


def _ask(model: ChatModel, prompt: str, what: str, max_tokens: int) -> str:
  (result,) = model.chat_many([[{"role": "user", "content": prompt}]],
                              max_tokens)
  if not result.ok:
    raise RuntimeError(f"{what} call failed: {result.error}")
  return result.text


class ChatCompressor:
  """Listing 5 over a `ChatModel`, answers of up to `max_tokens`; counts
  its calls."""

  def __init__(self, model: ChatModel, config: CoreConfig,
               max_tokens: int = DEFAULT_COMPRESS_MAX_TOKENS):
    self.model, self.config, self.max_tokens = model, config, max_tokens
    self.calls = 0

  def __call__(self, core: str) -> str:
    self.calls += 1
    prompt = build_compression_prompt(core, self.config.cap_chars,
                                      self.config.compress_target_chars)
    text = _ask(self.model, prompt, "compression", self.max_tokens)
    content = loads_llm_json(text).get("content")
    if not isinstance(content, str) or not content.strip():
      raise ValueError(f"no 'content' in the compression answer: "
                       f"{text[:80]!r}")
    return content.strip()


class ChatMergeSummarizer:
  """Listing 9 over a `ChatModel`: the answer (up to `max_tokens`) is the
  merged text itself."""

  def __init__(self, model: ChatModel,
               max_tokens: int = DEFAULT_MERGE_MAX_TOKENS):
    self.model, self.max_tokens = model, max_tokens
    self.calls = 0

  def __call__(self, agent_type: str, memories: Sequence[str]) -> str:
    self.calls += 1
    text = _ask(self.model, build_merge_prompt(agent_type, memories),
                "merge summary", self.max_tokens).strip()
    if not text:
      raise ValueError("empty merge summary")
    return text


def _model(memory: MemoryConfig, key: str,
           models: Mapping[str, ChatModel | None]) -> ChatModel | None:
  name = getattr(memory, key)
  if name == "none":
    return None
  if name == "external":
    # App. H.3's "external summarizer": an endpoint of its own, whatever
    # the job's other models are.
    return OpenAIClient(memory.summarizer_endpoint)
  model = models.get(name)
  if model is None:
    raise ValueError(f"memory.{key}={name!r}, but this job has no {name} "
                     f"model (have: {sorted(k for k, v in models.items() if v)})")
  # A local policy may decode under the DSL grammar; Listings 5 and 9 are
  # not DSL (`ChatPolicy.free_text`).
  free_text = getattr(model, "free_text", None)
  return free_text() if free_text is not None else model


def memory_editors(memory: MemoryConfig,
                   models: Mapping[str, ChatModel | None]) -> MemoryEditors:
  """`memory.compressor` and `memory.merge_summarizer` of a job over its
  models (`{"policy": ..., "answer": ...}`; a policy as its `free_text()`
  view), answers of up to `memory.compress_max_tokens` /
  `merge_max_tokens`; "none" leaves that rewrite to its counted fallback;
  a MERGE summariser "external" is the OpenAI-compatible endpoint
  `memory.summarizer_endpoint` (App. H.3).

  Raises:
    ValueError: a configured model is not part of this job.
  """
  compress = _model(memory, "compressor", models)
  merge = _model(memory, "merge_summarizer", models)
  return MemoryEditors(
      compress_core=compress and ChatCompressor(
          compress, core_config(memory), memory.compress_max_tokens),
      summarize_merge=merge and ChatMergeSummarizer(
          merge, memory.merge_max_tokens))
