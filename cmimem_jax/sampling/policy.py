"""The chat policy: model + tokenizer from the config, chat-template
prompts -> completions through a `GenerationEngine`, and the `ChatModel`
interface (`chat_many`) that evaluation and the server use."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import jax
from flax import nnx
from jax.sharding import Mesh

from cmimem_jax import storage
from cmimem_jax.client import CallResult, ChatModel, Messages, PromptFits
from cmimem_jax.config import Section, need, positive_int
from cmimem_jax.models.attention import ATTENTION_IMPLS
from cmimem_jax.models.hf_tokenizer import load_hf_tokenizer
from cmimem_jax.models.qwen3 import (Qwen3, Qwen3Config, load_gguf, load_hf,
                                     preset)
from cmimem_jax.models.qwen3.params import (load_gguf_tokenizer,
                                            smollm2_gguf_path)
from cmimem_jax.sampling.constraint import TokenConstraint
from cmimem_jax.sampling.engine import GenerationEngine
from cmimem_jax.sampling.sampler import (DEFAULT_BUCKETS, SampleOutput,
                                         Sampler, SamplingConfig)


# Files from which `AutoTokenizer` builds a tokenizer (any one suffices).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str) -> Any:
  """A HF tokenizer (with chat template) from a GGUF file or an HF
  directory; "" = the embedded SmolLM2-135M-Instruct GGUF."""
  path = path or smollm2_gguf_path()
  if path.endswith(".gguf"):
    return load_gguf_tokenizer(path)
  return load_hf_tokenizer(path)


POLICY_SOURCES = ("random", "gguf", "hf")


@dataclasses.dataclass(frozen=True)
class PolicyConfig(Section):
  """The `policy` section: the model that writes memories."""

  SECTION: ClassVar[str] = "policy"

  source: str                # One of POLICY_SOURCES.
  max_position_embeddings: int  # random: the context length.
  path: str = ""             # gguf: "" = the embedded SmolLM2; hf: a folder.
  preset: str = ""           # random: the architecture (`models.preset`).
  seed: int = 0              # random: the weights' seed.
  tokenizer: str = ""        # "": the checkpoint's own tokenizer.
  init_checkpoint: str = ""  # A train / sft workdir's weights replace these.
  dtype: str = "float32"
  param_dtype: str = "float32"
  remat: str = "none"
  attention_impl: str = "auto"  # One of ATTENTION_IMPLS.

  def invalid(self) -> Iterator[str]:
    yield from need(self, "source", lambda v: v in POLICY_SOURCES,
                    "random, gguf or hf")
    yield from need(self, "attention_impl", lambda v: v in ATTENTION_IMPLS,
                    f"one of {ATTENTION_IMPLS}")
    yield from need(self, "max_position_embeddings", positive_int,
                    "a positive integer")


def policy_runtime(section: PolicyConfig) -> dict[str, Any]:
  """The `policy` section's runtime settings of any architecture (dtype
  policy, rematerialisation, attention backend)."""
  return dict(dtype=section.dtype, param_dtype=section.param_dtype,
              remat=section.remat, attention_impl=section.attention_impl)


def random_policy_config(section: PolicyConfig, vocab_size: int,
                         **overrides: Any) -> Qwen3Config:
  """The architecture of source "random": the `preset`, vocabulary sized
  to the tokenizer (`overrides` last, e.g. a layer count)."""
  return preset(section.preset, vocab_size=vocab_size,
                max_position_embeddings=section.max_position_embeddings,
                **{**policy_runtime(section), **overrides})


def load_policy(section: PolicyConfig, vocab_size: int) -> Qwen3:
  """The policy from the `policy` config section.

  source "random": the `preset` architecture with random weights (vocab
  sized to the tokenizer); "gguf": a llama.cpp file ("" = the embedded
  SmolLM2); "hf": a HF checkpoint directory.
  """
  runtime = policy_runtime(section)
  if section.source == "random":
    return Qwen3(random_policy_config(section, vocab_size),
                 rngs=nnx.Rngs(section.seed))
  if section.source == "gguf":
    return load_gguf(section.path or smollm2_gguf_path(), **runtime)
  if section.source == "hf":
    return load_hf(section.path, Qwen3Config.from_pretrained(section.path,
                                                             **runtime))
  raise ValueError(f"unknown policy.source {section.source!r}")


def checkpoint_tokenizer_path(path: str) -> str:
  """The tokenizer that belongs to model checkpoint `path` (a GGUF file
  carries its own; an HF folder must hold tokenizer files; "" = the
  embedded SmolLM2). Raises ValueError for an HF folder without them:
  another model's tokenizer would silently give wrong token ids."""
  if path and os.path.isdir(path) and not any(
      os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
    raise ValueError(
        f"{path} holds no tokenizer ({' / '.join(TOKENIZER_FILES)}): copy "
        "the checkpoint's tokenizer files there or name one with "
        "policy.tokenizer")
  return path


def policy_tokenizer_path(section: PolicyConfig) -> str:
  """Where the `policy` section's tokenizer comes from: `tokenizer` when
  set; else the checkpoint's own for the `hf` and `gguf` sources; else
  (`random`) the embedded SmolLM2's."""
  if section.tokenizer:
    return section.tokenizer
  if section.source in ("hf", "gguf"):
    return checkpoint_tokenizer_path(section.path)
  return ""


def check_vocabulary(tokenizer: Any, vocab_size: int, model: str) -> None:
  """Raises ValueError, naming both sizes, when `tokenizer` has ids the
  model's embedding table (`vocab_size` rows) lacks."""
  if len(tokenizer) > vocab_size:
    raise ValueError(
        f"the tokenizer has {len(tokenizer)} tokens but {model}'s embedding "
        f"table has {vocab_size} rows: they belong to different models")


def load_policy_and_tokenizer(section: PolicyConfig) -> tuple[Qwen3, Any]:
  """The policy of the `policy` config section and its tokenizer, their
  vocabularies checked against each other (an HF checkpoint's before its
  weights are read)."""
  storage.require_local(section.path, "policy.path")
  storage.require_local(section.tokenizer, "policy.tokenizer")
  tokenizer = load_tokenizer(policy_tokenizer_path(section))
  name = section.path or f"the {section.source} policy"
  if section.source == "hf":
    check_vocabulary(tokenizer,
                     Qwen3Config.from_pretrained(section.path).vocab_size,
                     name)
  model = load_policy(section, len(tokenizer))
  check_vocabulary(tokenizer, model.config.vocab_size, name)
  return model, tokenizer


def encode_chat(tokenizer: Any, messages: Messages) -> list[int]:
  """The chat-template prompt ids of `messages`, ready for the assistant's
  turn."""
  ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                      tokenize=True)
  if hasattr(ids, "keys"):  # A BatchEncoding.
    ids = ids["input_ids"]
  return list(ids)


def token_budget(tokenizer: Any, max_prompt_tokens: int) -> PromptFits:
  """`PromptFits` for prompts of at most `max_prompt_tokens` chat-template
  tokens (`encode_chat`)."""
  return lambda messages: len(encode_chat(tokenizer, messages)) <= (
      max_prompt_tokens)


def special_ids(tokenizer: Any) -> tuple[tuple[int, ...], int]:
  """`(eos_ids, pad_id)` of a tokenizer, as every engine needs them."""
  eos = tokenizer.eos_token_id
  return (() if eos is None else (int(eos),)), int(tokenizer.pad_token_id or 0)


class ChatPolicy:
  """Chat-template prompts -> completions with any `GenerationEngine`.

  Args:
    engine: generates from token ids (`ChatPolicy.jax` builds the JAX
      sampler over a Flax model).
    tokenizer: a `transformers` tokenizer with a chat template.
    max_prompt_tokens: longer prompts are an error, never truncated.
    max_new_tokens / batch_size / seed: what `chat_many` (the `ChatModel`
      interface: greedy answers) generates, conversations per engine call,
      and its sampling key.
    prompt_limit_name: the setting `max_prompt_tokens` comes from (named
      in the error for a longer prompt).
  """

  def __init__(self, engine: GenerationEngine, tokenizer: Any,
               max_prompt_tokens: int, max_new_tokens: int = 256,
               batch_size: int = 8, seed: int = 0,
               prompt_limit_name: str = "rollout.max_prompt_tokens"):
    self.engine, self.tokenizer = engine, tokenizer
    self.max_prompt_tokens = max_prompt_tokens
    self.prompt_limit_name = prompt_limit_name
    self.max_new_tokens, self.batch_size = max_new_tokens, batch_size
    self.eos_ids, self.pad_id = special_ids(tokenizer)
    self._key = jax.random.key(seed)

  @classmethod
  def jax(cls, model: Qwen3, tokenizer: Any, max_prompt_tokens: int,
          buckets: Sequence[int] = DEFAULT_BUCKETS, mesh: Mesh | None = None,
          constraint: TokenConstraint | None = None,
          max_rows_per_wave: int = 0, share_prompts: bool = True,
          row_stop_shape: tuple[int, int] | None = None,
          decode_devices: str = "one", **kwargs: Any) -> ChatPolicy:
    """A policy generating with the JAX `Sampler` over `model` (every
    completion a match of `constraint`, if given; at most
    `max_rows_per_wave` rows decoded at once, 0 = all; `share_prompts`:
    identical consecutive prompts share one prefill; `row_stop_shape`:
    each row's own stop sequences; `decode_devices`: "one" or "mesh"
    device(s) of `mesh` decode; see `Sampler`)."""
    eos_ids, pad_id = special_ids(tokenizer)
    sampler = Sampler(model, SamplingConfig(eos_ids=eos_ids, pad_id=pad_id),
                      buckets=buckets, mesh=mesh, constraint=constraint,
                      max_rows_per_wave=max_rows_per_wave,
                      share_prompts=share_prompts,
                      row_stop_shape=row_stop_shape,
                      decode_devices=decode_devices)
    return cls(sampler, tokenizer, max_prompt_tokens, **kwargs)

  def set_model(self, model: Qwen3) -> None:
    """Generates from the latest weights (the JAX sampler keeps its
    compiled programs; vLLM receives the weights)."""
    self.engine.set_model(model)

  def prompt_fits(self, messages: Messages) -> bool:
    """Whether `encode` takes `messages` (`max_prompt_tokens`): the budget
    the policy's prompt is fitted to (`memory.PolicyPrompter`)."""
    return token_budget(self.tokenizer, self.max_prompt_tokens)(messages)

  def encode(self, messages: Messages) -> list[int]:
    ids = encode_chat(self.tokenizer, messages)
    if len(ids) > self.max_prompt_tokens:
      raise ValueError(
          f"prompt of {len(ids)} tokens exceeds "
          f"{self.prompt_limit_name}={self.max_prompt_tokens}")
    return list(ids)

  def decode(self, tokens: Sequence[int]) -> str:
    return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

  def decode_each(self, tokens: Sequence[int]) -> list[str]:
    """`decode([t])` of every token, in one call to a fast tokenizer's
    Rust decoder (0.004 s for 6,000 tokens, against 0.03 s through
    `batch_decode`'s Python loop); token by token otherwise."""
    backend = getattr(self.tokenizer, "backend_tokenizer", None)
    if backend is None or self.tokenizer.clean_up_tokenization_spaces:
      return [self.decode([t]) for t in tokens]
    return backend.decode_batch([[int(t)] for t in tokens],
                                skip_special_tokens=True)

  def completion_tokens(self, out: SampleOutput, row: int) -> list[int]:
    """The completion without its trailing EOS (what the text is)."""
    tokens = out.tokens[row, :out.lengths[row]].tolist()
    if tokens and tokens[-1] in self.eos_ids:
      tokens = tokens[:-1]
    return tokens

  def generate(self, prompts: Sequence[list[int]], key: jax.Array,
               temperature: float | Sequence[float],
               top_p: float | Sequence[float], max_new_tokens: int,
               row_budgets: Sequence[int] | None = None,
               constrained: bool = True,
               row_stops: Sequence[Sequence[Sequence[int]]] | None = None
               ) -> SampleOutput:
    """`GenerationEngine.generate` on this policy's engine; `row_stops`
    (each row's stop token sequences) for a JAX sampler made with
    `row_stop_shape`."""
    if row_stops is None:
      return self.engine.generate(prompts, key, temperature, top_p,
                                  max_new_tokens, row_budgets, constrained)
    return self.engine.generate(prompts, key, temperature, top_p,
                                max_new_tokens, row_budgets, constrained,
                                row_stops=row_stops)

  def generate_waves(self, prompts: Sequence[list[int]], key: jax.Array,
                     temperature: float | Sequence[float],
                     top_p: float | Sequence[float], max_new_tokens: int,
                     ahead: bool = True) -> Iterator[SampleOutput]:
    """`GenerationEngine.generate_waves` on this policy's engine: `generate`'s
    output one decoding wave at a time, as each is decoded."""
    return self.engine.generate_waves(prompts, key, temperature, top_p,
                                      max_new_tokens, ahead=ahead)

  def stop_tokens(self, text: str) -> list[int]:
    """The token ids a stop string is written with on its own (a model
    writing it otherwise is cut by the text, not the sampler)."""
    return list(self.tokenizer.encode(text, add_special_tokens=False))

  def respond(self, conversations: Sequence[Messages], max_new_tokens: int
              ) -> list[str]:
    """Greedy responses in one engine call (snapshots, before/after
    demos)."""
    out = self.generate([self.encode(m) for m in conversations],
                        jax.random.key(0), 0.0, 1.0, max_new_tokens)
    return [self.decode(self.completion_tokens(out, i))
            for i in range(len(conversations))]

  def chat_many(self, conversations: Sequence[Messages],
                max_tokens: int | None = None, constrained: bool = True
                ) -> list[CallResult]:
    """`ChatModel`: greedy answers of at most `max_tokens` tokens (default
    `max_new_tokens`), `batch_size` conversations per call; under the
    engine's grammar unless `constrained=False`."""
    results = []
    for start in range(0, len(conversations), self.batch_size):
      batch = [self.encode(m) for m in
               conversations[start:start + self.batch_size]]
      self._key, key = jax.random.split(self._key)
      out = self.generate(batch, key, 0.0, 1.0,
                          max_tokens or self.max_new_tokens,
                          constrained=constrained)
      results += [CallResult(self.decode(tokens))
                  for tokens in out.completions()]
    return results

  def free_text(self) -> ChatModel:
    """This policy as a `ChatModel` for prompts that are not the memory
    DSL (Listing 5 compression, Listing 9 merge summaries): the current
    weights, never the DSL grammar, `max_tokens` per call."""
    return _FreeText(self)


class _FreeText:
  """`ChatPolicy.free_text`."""

  def __init__(self, policy: ChatPolicy):
    self.policy = policy

  def chat_many(self, conversations: Sequence[Messages],
                max_tokens: int | None = None) -> list[CallResult]:
    return self.policy.chat_many(conversations, max_tokens, constrained=False)
