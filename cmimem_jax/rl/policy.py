"""The policy side of training: model + tokenizer from the config, and
chat-prompt generation through the sampler."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from cmimem_jax.models.qwen3 import Qwen3, load_gguf, load_hf, preset
from cmimem_jax.models.qwen3.params import (load_gguf_tokenizer,
                                            smollm2_gguf_path)
from cmimem_jax.sampling.sampler import Sampler, SampleOutput, SamplingConfig

Messages = list[dict[str, str]]


def load_tokenizer(path: str) -> Any:
  """A HF tokenizer (with chat template) from a GGUF file or an HF
  directory; "" = the embedded SmolLM2-135M-Instruct GGUF."""
  path = path or smollm2_gguf_path()
  if path.endswith(".gguf"):
    return load_gguf_tokenizer(path)
  from transformers import AutoTokenizer
  return AutoTokenizer.from_pretrained(path)


def load_policy(section: Any, vocab_size: int) -> Qwen3:
  """The policy from the `policy` config section.

  source "random": the `preset` architecture with random weights (vocab
  sized to the tokenizer); "gguf": a llama.cpp file ("" = the embedded
  SmolLM2); "hf": a HF checkpoint directory.
  """
  runtime = dict(dtype=section.dtype, param_dtype=section.param_dtype,
                 remat=section.remat)
  if section.source == "random":
    config = preset(section.preset, vocab_size=vocab_size,
                    max_position_embeddings=section.max_position_embeddings,
                    **runtime)
    return Qwen3(config, rngs=nnx.Rngs(section.seed))
  if section.source == "gguf":
    return load_gguf(section.path or smollm2_gguf_path(), **runtime)
  if section.source == "hf":
    from cmimem_jax.models.qwen3 import Qwen3Config
    return load_hf(section.path, Qwen3Config.from_pretrained(section.path,
                                                             **runtime))
  raise ValueError(f"unknown policy.source {section.source!r}")


class ChatPolicy:
  """Chat-template prompts -> sampled completions with the Flax policy."""

  def __init__(self, model: Qwen3, tokenizer: Any, max_prompt_tokens: int,
               buckets: Sequence[int], mesh: Mesh | None = None):
    self.tokenizer = tokenizer
    self.max_prompt_tokens = max_prompt_tokens
    eos = tokenizer.eos_token_id
    self.eos_ids = () if eos is None else (int(eos),)
    self.pad_id = int(tokenizer.pad_token_id or 0)
    self.sampler = Sampler(model, SamplingConfig(eos_ids=self.eos_ids,
                                                 pad_id=self.pad_id),
                           buckets=buckets, mesh=mesh)

  def set_model(self, model: Qwen3) -> None:
    """Points the sampler at the latest weights (same graph: no
    recompilation)."""
    self.sampler.model = model

  def encode(self, messages: Messages) -> list[int]:
    ids = self.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):
      ids = ids["input_ids"]
    if len(ids) > self.max_prompt_tokens:
      raise ValueError(
          f"policy prompt of {len(ids)} tokens exceeds "
          f"rollout.max_prompt_tokens={self.max_prompt_tokens}")
    return list(ids)

  def decode(self, tokens: Sequence[int]) -> str:
    return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

  def completion_tokens(self, out: SampleOutput, row: int) -> list[int]:
    """The completion without its trailing EOS (what the text is)."""
    tokens = out.tokens[row, :out.lengths[row]].tolist()
    if tokens and tokens[-1] in self.eos_ids:
      tokens = tokens[:-1]
    return tokens

  def generate(self, prompts: Sequence[list[int]], key: jax.Array,
               temperature: float, top_p: float, max_new_tokens: int
               ) -> SampleOutput:
    config = SamplingConfig(temperature=temperature, top_p=top_p,
                            max_new_tokens=max_new_tokens,
                            eos_ids=self.eos_ids, pad_id=self.pad_id)
    return self.sampler(prompts, key, config)

  def respond(self, conversations: Sequence[Messages], max_new_tokens: int
              ) -> list[str]:
    """Greedy responses (snapshots, before/after demos)."""
    out = self.generate([self.encode(m) for m in conversations],
                        jax.random.key(0), 0.0, 1.0, max_new_tokens)
    return [self.decode(self.completion_tokens(out, i))
            for i in range(len(conversations))]
