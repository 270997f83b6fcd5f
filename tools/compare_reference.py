"""Compares our Flax model with the `transformers` PyTorch reference.

  python -m tools.compare_reference --hf_checkpoint=DIR [--kind=causal_lm]
  python -m tools.compare_reference --hf_checkpoint=DIR --kind=embedding
  python -m tools.compare_reference --hf_checkpoint=DIR --kind=bert
  python -m tools.compare_reference --gguf=FILE [--hf_checkpoint=DIR]
  python -m tools.compare_reference --hf_checkpoint=DIR --attention_impl=splash

Both sides load the same checkpoint in float32 and run the same padded token
batch (left padding for decoders, right for BERT). Prints one JSON line:
`{"kind", "max_abs_diff", "mean_abs_diff", "n_tokens", ...}` over logits of
real tokens (causal LM) or pooled, L2-normalised embeddings (encoders). With
--gguf, both load the GGUF file (transformers dequantises it itself).
--attention_impl picks our decoders' attention backend (`models.attention`;
"splash" runs the Pallas kernel in interpret mode on a CPU); the JSON line
then carries it.
"""

from __future__ import annotations

import json
import os

import numpy as np
from absl import app, flags

from cmimem_jax.config import run_command
from cmimem_jax.models.attention import ATTENTION_IMPLS

# This tool's flags (its own: tools share flag names).
FLAGS = flags.FlagValues()
flags.DEFINE_string("hf_checkpoint", None, "HF checkpoint folder.",
                    flag_values=FLAGS)
flags.DEFINE_enum("kind", "causal_lm", ("causal_lm", "embedding", "bert"),
                  "What the checkpoint is.", flag_values=FLAGS)
flags.DEFINE_string("gguf", None, "GGUF file (causal_lm only).",
                    flag_values=FLAGS)
flags.DEFINE_integer("seed", 0, "Seed of the token batch.", flag_values=FLAGS)
flags.DEFINE_enum("attention_impl", "auto", ATTENTION_IMPLS,
                  "Our decoders' attention backend.", flag_values=FLAGS)


def _batch(vocab: int, seed: int, left: bool, batch: int = 4,
           length: int = 24) -> tuple[np.ndarray, np.ndarray]:
  rng = np.random.default_rng(seed)
  tokens = np.zeros((batch, length), np.int64)
  mask = np.zeros((batch, length), np.int64)
  for row, n in enumerate(np.linspace(length, length // 3, batch).astype(int)):
    span = slice(length - n, length) if left else slice(0, n)
    tokens[row, span] = rng.integers(1, vocab, n)
    mask[row, span] = 1
  return tokens, mask


def _diff(ours: np.ndarray, ref: np.ndarray, kind: str, n_tokens: int) -> dict:
  delta = np.abs(np.asarray(ours, np.float64) - np.asarray(ref, np.float64))
  return {"kind": kind, "max_abs_diff": float(delta.max()),
          "mean_abs_diff": float(delta.mean()), "n_tokens": int(n_tokens)}


def compare_causal_lm(directory: str | None, gguf: str | None,
                      seed: int, attention_impl: str = "auto") -> dict:
  import torch
  import transformers

  from cmimem_jax.models.qwen3 import load_gguf, load_hf, positions_from_mask
  if gguf:
    folder, name = os.path.dirname(os.path.abspath(gguf)), os.path.basename(gguf)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, torch_dtype=torch.float32).eval()
    ours = load_gguf(gguf, attention_impl=attention_impl)
  else:
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        directory, torch_dtype=torch.float32).eval()
    ours = load_hf(directory, attention_impl=attention_impl)
  tokens, mask = _batch(ours.config.vocab_size, seed, left=True)
  positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
  with torch.no_grad():
    want = ref(input_ids=torch.from_numpy(tokens),
               attention_mask=torch.from_numpy(mask),
               position_ids=torch.from_numpy(positions)).logits.numpy()
  got, _ = ours(tokens.astype(np.int32), positions_from_mask(mask), mask)
  real = mask.astype(bool)
  result = _diff(np.asarray(got)[real], want[real], "causal_lm", real.sum())
  result["argmax_agreement"] = float(np.mean(
      np.asarray(got)[real].argmax(-1) == want[real].argmax(-1)))
  return result


def compare_embedding(directory: str, seed: int,
                      attention_impl: str = "auto") -> dict:
  import torch
  import transformers

  from cmimem_jax.encoders.neural import last_token_pool
  from cmimem_jax.models.qwen3 import load_hf, positions_from_mask
  ref = transformers.AutoModel.from_pretrained(
      directory, torch_dtype=torch.float32).eval()
  ours = load_hf(directory, lm_head=False, attention_impl=attention_impl)
  tokens, mask = _batch(ours.config.vocab_size, seed, left=True)
  positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
  with torch.no_grad():
    hidden = ref(input_ids=torch.from_numpy(tokens),
                 attention_mask=torch.from_numpy(mask),
                 position_ids=torch.from_numpy(positions)).last_hidden_state
  want = torch.nn.functional.normalize(hidden[:, -1], dim=-1).numpy()
  got_hidden, _ = ours.hidden_states(tokens.astype(np.int32),
                                     positions_from_mask(mask), mask)
  got = np.asarray(last_token_pool(got_hidden, mask))
  return _diff(got, want, "embedding", mask.sum())


def compare_bert(directory: str, seed: int) -> dict:
  import torch
  import transformers

  from cmimem_jax.models.bert import load_bert, mean_pool
  ref = transformers.AutoModel.from_pretrained(
      directory, torch_dtype=torch.float32).eval()
  ours = load_bert(directory)
  tokens, mask = _batch(ours.config.vocab_size, seed, left=False)
  with torch.no_grad():
    hidden = ref(input_ids=torch.from_numpy(tokens),
                 attention_mask=torch.from_numpy(mask)).last_hidden_state
  m = torch.from_numpy(mask)[..., None].float()
  want = torch.nn.functional.normalize((hidden * m).sum(1) / m.sum(1),
                                       dim=-1).numpy()
  got = np.asarray(mean_pool(ours(tokens.astype(np.int32), mask), mask))
  return _diff(got, want, "bert", mask.sum())


def main(argv: list[str]) -> dict:
  del argv
  args = FLAGS
  if not args.hf_checkpoint and not args.gguf:
    raise app.UsageError("give --hf_checkpoint and/or --gguf")
  if args.kind == "causal_lm":
    result = compare_causal_lm(args.hf_checkpoint, args.gguf, args.seed,
                               args.attention_impl)
  elif args.gguf:
    raise app.UsageError("--gguf is for --kind=causal_lm")
  elif args.kind == "embedding":
    result = compare_embedding(args.hf_checkpoint, args.seed,
                               args.attention_impl)
  else:
    result = compare_bert(args.hf_checkpoint, args.seed)
  if args.kind != "bert":
    result["attention_impl"] = args.attention_impl
  print(json.dumps(result))
  return result


if __name__ == "__main__":
  run_command(main, flag_values=FLAGS, compilation_cache=False)
