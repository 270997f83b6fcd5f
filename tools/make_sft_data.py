"""Writes teacher trajectories (policy prompt -> valid DSL response) as JSONL
for the supervised warm start (`python -m cmimem_jax.sft`).

  # LoCoMo's own annotations as the teacher, conversations 0-6:
  python -m tools.make_sft_data --input=../shared/data/locomo/locomo10.json \
      --dialogues=0:7 --output=/tmp/sft.jsonl
  # Any OpenAI-compatible chat model as the teacher:
  python -m tools.make_sft_data --input=... --base_url=http://HOST/v1 \
      --model=NAME --output=/tmp/sft.jsonl
  # The user's own sentences, any dataset (`make demo`'s warm start), each
  # response within an 80-token rollout:
  python -m tools.make_sft_data --teacher=extractive --dataset=longmemeval \
      --input=cmimem_jax/data/bundled/longmemeval_train_sample.json \
      --max_response_tokens=80 --output=/tmp/sft.jsonl

Each record's prompt is what the RL policy sees for that session (the bank
built so far by the teacher's own earlier answers); only valid responses
are kept, and the rejected ones are counted in the printed summary. With
`--max_prompt_tokens=T` a prompt over T tokens is written with fewer
retrieved entries per type (`retrieved_per_type` in the record; `trimmed`
in the summary counts them), so the warm start can train on late
sessions, whose prompts carry a large bank, instead of skipping them.
"""

from __future__ import annotations

import collections
import json

from absl import app, flags

from cmimem_jax.client import EndpointConfig, OpenAIClient
from cmimem_jax.config import (CallsFailed, check_failures, memory_defaults,
                               run_command)
from cmimem_jax.data import load_dataset
from cmimem_jax.encoders import EncoderConfig, make_encoder
from cmimem_jax.memory.builder import MemoryConfig
from cmimem_jax.sampling import (PolicyConfig, load_tokenizer,
                                 policy_tokenizer_path, token_budget)
from cmimem_jax.task.build_memory import annotation_responder
from cmimem_jax.task.warm_start import (endpoint_teacher, extractive_teacher,
                                        response_budget, teacher_trajectories,
                                        trimmed_count, write_jsonl)
from configs import default

# This tool's flags (its own: tools share flag names).
FLAGS = flags.FlagValues()
flags.DEFINE_string("input", None, "Dataset file.", flag_values=FLAGS,
                    required=True)
flags.DEFINE_string("dataset", "locomo", "locomo | longmemeval | "
                    "memoryagentbench.", flag_values=FLAGS)
flags.DEFINE_string("dialogues", ":", "START:STOP slice of the dialogues to "
                    "use.", flag_values=FLAGS)
flags.DEFINE_string("output", None, "JSONL to write.", flag_values=FLAGS,
                    required=True)
flags.DEFINE_string("encoder", "minilm", "Encoder for the prompt's "
                    "retrieved memories (the training config's: minilm | "
                    "hashing).", flag_values=FLAGS)
flags.DEFINE_integer("dim", 384, "The encoder's dimension.",
                     flag_values=FLAGS)
flags.DEFINE_integer("top_k", 20, "Retrieved entries per type in the "
                     "prompt.", flag_values=FLAGS)
flags.DEFINE_integer("max_prompt_tokens", 0, "> 0: a prompt over this many "
                     "tokens is written with fewer retrieved entries per "
                     "type, the least similar dropped first, until it fits "
                     "(the teacher still answers the full prompt).",
                     flag_values=FLAGS)
flags.DEFINE_string("tokenizer", "", "Tokenizer for --max_prompt_tokens and "
                    "--max_response_tokens (default: the default config's "
                    "policy tokenizer).", flag_values=FLAGS)
flags.DEFINE_enum("teacher", "", ("", "annotations", "extractive",
                                  "endpoint"),
                  "annotations: LoCoMo's (observations, event summaries); "
                  "extractive: the user's own sentences (any dataset); "
                  "endpoint: --base_url's model (default: endpoint when "
                  "--base_url is set, else annotations).", flag_values=FLAGS)
flags.DEFINE_integer("max_response_tokens", 0, "> 0: the extractive teacher "
                     "writes only as many sentences as fit this many tokens, "
                     "EOS included.", flag_values=FLAGS)
flags.DEFINE_string("base_url", "", "Teacher endpoint.", flag_values=FLAGS)
flags.DEFINE_string("model", "", "Teacher model name.", flag_values=FLAGS)
flags.DEFINE_float("max_failure_rate", 0.0, "--teacher=endpoint: the share "
                   "of failed teacher calls accepted (their sessions are "
                   "rejected); above it, or when every call failed, nothing "
                   "is written and the command exits 1.", flag_values=FLAGS)


def dialogue_slice(text: str) -> slice:
  """"START:STOP" (either may be empty) over the dataset's dialogues."""
  start, _, stop = text.partition(":")
  return slice(int(start) if start else None, int(stop) if stop else None)


def main(argv: list[str]) -> dict:
  del argv
  args = FLAGS
  teacher = args.teacher or ("endpoint" if args.base_url else "annotations")
  if (teacher == "endpoint") != bool(args.base_url):
    raise app.UsageError("--base_url goes with --teacher=endpoint, and only "
                         "with it")
  if args.max_response_tokens and teacher != "extractive":
    raise app.UsageError("--max_response_tokens is the extractive teacher's")
  dialogues = load_dataset(args.dataset, args.input)[
      dialogue_slice(args.dialogues)]
  encoder = make_encoder(EncoderConfig.from_config(
      {"kind": args.encoder, "dim": args.dim, "path": ""}, path="encoder"))
  memory = MemoryConfig.from_config(memory_defaults())
  tokenizer = None
  if args.max_prompt_tokens > 0 or args.max_response_tokens > 0:
    tokenizer = load_tokenizer(
        args.tokenizer or policy_tokenizer_path(
            PolicyConfig.from_config(default.get_config().policy)))
  fits = None
  if args.max_prompt_tokens > 0:
    fits = token_budget(tokenizer, args.max_prompt_tokens)
  failures: collections.Counter[str] = collections.Counter()
  if teacher == "endpoint":
    responder = endpoint_teacher(OpenAIClient(EndpointConfig(
        base_url=args.base_url, model=args.model)), encoder, args.top_k,
                                 failures)
    source = f"teacher:{args.model}"
  elif teacher == "extractive":
    budget = (response_budget(tokenizer, args.max_response_tokens)
              if args.max_response_tokens else None)
    responder = extractive_teacher(budget)
    source = "extractive"
  else:
    responder, source = annotation_responder, "annotations"
  records, rejected = teacher_trajectories(dialogues, encoder, responder,
                                           memory, args.top_k, source, fits)
  try:
    # A failed call is never a trajectory: one teacher call per session.
    check_failures(failures["policy_call"],
                   sum(len(d.sessions) for d in dialogues),
                   args.max_failure_rate, f"teacher calls to {args.base_url}",
                   kept=f"nothing written to {args.output}")
  except CallsFailed as e:
    raise SystemExit(f"error: {e}") from None
  write_jsonl(args.output, records)
  summary = {"output": args.output, "dialogues": len(dialogues),
             "records": len(records), "rejected": rejected,
             "trimmed": trimmed_count(records, args.top_k),
             "dialogue_ids": sorted({r["dialogue_id"] for r in records})}
  print(json.dumps(summary))
  return summary


if __name__ == "__main__":
  run_command(main, flag_values=FLAGS)
