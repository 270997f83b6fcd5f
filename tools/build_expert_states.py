"""Builds the fixed expert memory states M_{t-1} that the paper's GRPO run
trains on (its data was "synthesized by deepseek-v4-pro following the
protocol of Shen et al. (2026)": MemBuilder's `state_before` of each
session), with any OpenAI-compatible teacher model.

  python -m tools.build_expert_states --config=configs/qwen3_4b.py \
      --config.dataset.path=/data/longmemeval_rl_qa.json \
      --config.encoder.path=/ckpt/Qwen3-Embedding-0.6B \
      --output=/data/expert_states --base_url=https://HOST/v1 \
      --model=deepseek-v4-pro [--format=agents|dsl]
  python -m cmimem_jax.train --config=configs/qwen3_4b_tpu.py \
      --config.rl.snapshots=/data/expert_states ...

The teacher answers the four JSON agent prompts (Listings 1-4, MemBuilder's
protocol; `--format=agents`) or the policy's DSL prompt (Listings 6-7;
`--format=dsl`) for each session of the config's training dialogues, and
each state is saved as soon as it exists in the snapshot format the
trainer reads (`DIR/<dialogue_id>/s<t>/`). A rerun continues where the
last one stopped; rejected (invalid) teacher responses leave the state
unchanged and are counted, every response is kept in `teacher.jsonl`.
A teacher call that fails (after the client's retries) is no state: its
dialogue stops there and the next run asks again. The run prints its
counts as one JSON line, then exits 1 with one line naming the endpoint
when every teacher call failed, or when more than `--max_failure_rate`
of them did (default 0: any). The encoder of the config embeds the
entries: train with the same one.
"""

from __future__ import annotations

import collections
import json
import os

from absl import app, flags

from cmimem_jax.client import EndpointConfig, OpenAIClient
from cmimem_jax.config import (check_failures, define_command_line_flags,
                               run_command, validate_config)
from cmimem_jax.data import DatasetConfig
from cmimem_jax.encoders import EncoderConfig, encoder_identity, make_encoder
from cmimem_jax.evaluation.builders import agents_responder, policy_responder
from cmimem_jax.memory.builder import MemoryConfig
from cmimem_jax.memory.compression import memory_editors
from cmimem_jax.task.loop import RolloutConfig, training_dialogues
from cmimem_jax.task.snapshots import build_expert_snapshots

FORMATS = ("agents", "dsl")

# This tool's flags (its own: tools share flag names).
FLAGS = flags.FlagValues()
define_command_line_flags(workdir=False, flag_values=FLAGS)

flags.DEFINE_string("output", None, "Directory of the expert states.",
                    flag_values=FLAGS)
flags.DEFINE_string("base_url", None, "The teacher's OpenAI-compatible URL.",
                    flag_values=FLAGS)
flags.DEFINE_string("model", None, "The teacher model's name.",
                    flag_values=FLAGS)
flags.DEFINE_enum("format", "agents", FORMATS,
                  "agents: Listings 1-4 (MemBuilder); dsl: Listings 6-7.",
                  flag_values=FLAGS)
flags.DEFINE_string("api_key_env", "OPENAI_API_KEY",
                    "Environment variable holding the teacher's API key.",
                    flag_values=FLAGS)
flags.DEFINE_integer("max_tokens", 6000, "Teacher answer budget (tokens).",
                     flag_values=FLAGS)
flags.DEFINE_integer("concurrency", 4, "Agent calls in flight at once.",
                     flag_values=FLAGS)
flags.DEFINE_float("timeout_s", 300.0, "Per-call timeout of the teacher.",
                   flag_values=FLAGS)
flags.DEFINE_integer("max_retries", 3, "Retries of a failed teacher call.",
                     flag_values=FLAGS)
flags.DEFINE_float("max_failure_rate", 0.0,
                   "Exit 0 although up to this fraction of the teacher calls "
                   "failed (their states stay missing for a rerun).",
                   flag_values=FLAGS)


def build(config, output: str, teacher, teacher_name: str,
          answer_format: str) -> dict:
  """Builds (or continues) the expert states of `config`'s training
  dialogues in `output` with the `teacher` ChatModel; returns the counts."""
  # What this tool reads (the config also holds a trainer's sections, e.g.
  # rl.snapshots, which names this tool's output).
  sections = validate_config(config, required=(
      DatasetConfig, EncoderConfig, MemoryConfig, RolloutConfig))
  if answer_format not in FORMATS:
    raise ValueError(f"format must be one of {FORMATS}")
  encoder = make_encoder(sections[EncoderConfig])
  dialogues = training_dialogues(sections[DatasetConfig])
  failures: collections.Counter[str] = collections.Counter()
  top_k = sections[RolloutConfig].retrieval_top_k
  memory, dataset = sections[MemoryConfig], sections[DatasetConfig]
  respond = (agents_responder(teacher, encoder, top_k,
                              memory.core_cap_chars, failures,
                              raise_on_failure=True)
             if answer_format == "agents" else
             policy_responder(teacher, encoder, top_k, failures,
                              raise_on_failure=True))
  # The teacher stands in for the policy (and any answer model) when the
  # memory settings ask a model to compress the core or summarise merges.
  editors = memory_editors(memory, {"policy": teacher, "answer": teacher})
  # As the config held them (`as_config_dict`): a resumed build compares.
  settings = {"encoder": encoder_identity(sections[EncoderConfig]),
              "memory": memory.as_config_dict(),
              "teacher": {"model": teacher_name, "format": answer_format},
              "dataset": {"name": dataset.name,
                          "file": os.path.abspath(dataset.path),
                          "split": dataset.split}}
  counts = build_expert_snapshots(dialogues, respond, encoder, memory,
                                  output, settings, editors)
  return {"output": output, **counts, "failed_calls": dict(failures)}


def main(argv: list[str]) -> None:
  del argv
  for name in ("output", "base_url", "model"):
    if not getattr(FLAGS, name):
      raise app.UsageError(f"--{name} is required")
  if not 0.0 <= FLAGS.max_failure_rate <= 1.0:
    raise app.UsageError("--max_failure_rate must be in [0, 1]")
  teacher = OpenAIClient(EndpointConfig(
      base_url=FLAGS.base_url, model=FLAGS.model,
      api_key_env=FLAGS.api_key_env, timeout_s=FLAGS.timeout_s,
      max_retries=FLAGS.max_retries,
      concurrency=FLAGS.concurrency,
      max_tokens=FLAGS.max_tokens))
  counts = build(FLAGS.config, FLAGS.output, teacher,
                 FLAGS.model, FLAGS.format)
  print(json.dumps(counts), flush=True)
  check_failures(counts["failed"], counts["built"] + counts["failed"],
                 FLAGS.max_failure_rate,
                 f"sessions' teacher calls to {FLAGS.base_url} "
                 f"(attempts by kind: "
                 f"{teacher.failures.as_dict()['failed_attempts']})",
                 f"{counts['missing']} states not built, none saved from a "
                 "failed call: rerun to build them")


if __name__ == "__main__":
  run_command(main, flag_values=FLAGS)
