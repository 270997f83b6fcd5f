"""Offline stand-ins for the paper's checkpoints, for rehearsals and tests:
random-weight HF checkpoints shaped like Qwen3-4B-Instruct (a causal LM)
and Qwen3-Embedding (no LM head), each with its own small byte-level BPE
tokenizer and a Qwen-style chat template (`<|im_start|>` ... `<|im_end|>`).

The tokenizer is trained on the text it is given, so its vocabulary
differs from the embedded SmolLM2 tokenizer's (49,152 tokens): a run that
read the wrong tokenizer feeds ids the checkpoint does not have, or ids of
other text, and is caught.

  python -m cmimem_jax.testing.standins --output=DIR [--vocab_size=640]
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

from absl import flags
from flax import nnx

from cmimem_jax.config import run_command
from cmimem_jax.data import bundled_path
from cmimem_jax.models.qwen3 import Qwen3, preset, save_hf

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen's chat template, less tools and thinking.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Shapes of the stand-ins: Qwen3's (GQA, q/k-norm, head_dim != hidden /
# heads), small enough to train on 2 CPU cores.
POLICY_SHAPE = dict(hidden_size=64, intermediate_size=128,
                    num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=24,
                    rope_theta=1_000_000.0, max_position_embeddings=32768)
ENCODER_SHAPE = dict(hidden_size=32, intermediate_size=64,
                     num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=16,
                     max_position_embeddings=8192)


def corpus(path: str = "") -> list[str]:
  """Every turn of a LongMemEval-format file (default: the bundled
  training sample) plus the DSL's keywords, to train a tokenizer on."""
  with open(path or bundled_path()) as f:
    records = json.load(f)
  texts = ["CORE:APPEND| CORE:REPLACE| EPISODIC:ADD| EPISODIC:MERGE| "
           "SEMANTIC:UPDATE| PROCEDURAL:SKIP SKIP ADD UPDATE MERGE "
           "REWRITE DELETE"]
  for record in records:
    for session in record.get("haystack_sessions", []):
      texts.extend(turn["content"] for turn in session)
  return texts


def make_tokenizer(directory: str, texts: Iterable[str],
                   vocab_size: int = 640):
  """Trains a byte-level BPE tokenizer on `texts` and saves it (with the
  chat template) in `directory`; returns it."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  from transformers import PreTrainedTokenizerFast
  bpe = Tokenizer(models.BPE())
  bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  bpe.decoder = decoders.ByteLevel()
  bpe.train_from_iterator(texts, trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tokenizer = PreTrainedTokenizerFast(
      tokenizer_object=bpe, eos_token="<|im_end|>",
      pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)
  tokenizer.save_pretrained(directory)
  return tokenizer


def _padded(size: int, multiple: int = 64) -> int:
  # Like Qwen3's (151,936 rows for 151,669 tokens): the table is larger.
  return -(-size // multiple) * multiple


def make_policy_checkpoint(directory: str, tokenizer, seed: int = 0) -> str:
  """A random Qwen3 causal LM sized to `tokenizer`, saved with it as an HF
  checkpoint in `directory`."""
  config = preset("qwen3_4b", vocab_size=_padded(len(tokenizer)),
                  eos_token_id=tokenizer.eos_token_id, **POLICY_SHAPE)
  save_hf(Qwen3(config, rngs=nnx.Rngs(seed)), directory)
  tokenizer.save_pretrained(directory)
  return directory


def make_encoder_checkpoint(directory: str, tokenizer, seed: int = 1) -> str:
  """A random Qwen3-Embedding-shaped model (no LM head) with `tokenizer`,
  saved as an HF checkpoint in `directory`."""
  config = preset("qwen3_0p6b", vocab_size=_padded(len(tokenizer)),
                  eos_token_id=tokenizer.eos_token_id, **ENCODER_SHAPE)
  save_hf(Qwen3(config, rngs=nnx.Rngs(seed), lm_head=False), directory)
  tokenizer.save_pretrained(directory)
  return directory


def make_all(output: str, vocab_size: int = 640) -> dict[str, str]:
  """`output/{policy,encoder}`: the two stand-in checkpoints, sharing one
  tokenizer trained on the bundled sample; returns their paths."""
  tokenizer = make_tokenizer(os.path.join(output, "tokenizer"), corpus(),
                             vocab_size)
  return {"policy": make_policy_checkpoint(
              os.path.join(output, "policy"), tokenizer),
          "encoder": make_encoder_checkpoint(
              os.path.join(output, "encoder"), tokenizer)}


FLAGS = flags.FlagValues()
flags.DEFINE_string("output", None, "Directory of the stand-ins.",
                    flag_values=FLAGS, required=True)
flags.DEFINE_integer("vocab_size", 640, "The tokenizer's vocabulary.",
                     flag_values=FLAGS)


def main(argv: list[str]) -> None:
  del argv
  print(json.dumps(make_all(FLAGS.output, FLAGS.vocab_size)))


if __name__ == "__main__":
  run_command(main, flag_values=FLAGS)
