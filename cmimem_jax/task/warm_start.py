"""Supervised warm start (SFT) for policies too small to follow the DSL.

Teacher trajectories are (policy prompt, DSL response) pairs: the prompt
is exactly what the RL policy sees for a session (Listings 6-7 over the
bank built so far, `memory.PolicyPrompter`), the response a valid DSL
answer — from LoCoMo's own annotations (`annotation_trajectories`), the
user's own sentences on any dataset (`extractive_teacher`) or any chat
model (`endpoint_teacher`; invalid answers are rejected and counted, never
trained on). Responses are written canonically (types in
Listing 6's order, one operation per line, a trailing newline), the form
grammar-constrained decoding produces.

`run_sft` trains on them with the same sharded `rl.Learner` step as GRPO
(`SFTLossConfig`: NLL of the response tokens only), the same
checkpoints and metrics; `policy.init_checkpoint=DIR` starts GRPO from
the result (`rl.load_model_weights`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, ClassVar

import jax
import ml_collections
import numpy as np
from absl import logging

from cmimem_jax import storage
from cmimem_jax.client import ChatModel, PromptFits
from cmimem_jax.config import (Interrupted, Section, location_problem, need,
                               positive_int, validate_config, write_config)
from cmimem_jax.data.files import WorkdirLock, write_atomic
from cmimem_jax.data.types import Dialogue, Session
from cmimem_jax.encoders.base import Encoder
from cmimem_jax.evaluation.builders import policy_responder
from cmimem_jax.memory.bank import MemoryBank
from cmimem_jax.memory.builder import MemoryConfig, Responder, build_bank
from cmimem_jax.memory.dsl import ParsedResponse, render, rendered_response
from cmimem_jax.memory.extractive import ResponseFits, extractive_operations
from cmimem_jax.memory.prompt_builder import PolicyPrompter
from cmimem_jax.memory.types import MemoryType, Operation
from cmimem_jax.models.host_memory import return_large_blocks
from cmimem_jax.parallel import MeshConfig, batch_divisor, make_mesh
from cmimem_jax.rl.checkpoint import metrics_follow_checkpoints
from cmimem_jax.rl import (CheckpointConfig, Checkpointer, Learner,
                           MetricsWriter,
                           OptimizerConfig, SFTLossConfig, StopSignals,
                           TrainStepConfig, supervised_batch)
from cmimem_jax.sampling import (PolicyConfig, bucket_length, encode_chat,
                                 load_policy_and_tokenizer)
from cmimem_jax.task.build_memory import annotation_responder
from cmimem_jax.task.loop import RunConfig

_TYPE_ORDER = {t: i for i, t in enumerate(MemoryType)}


def canonical_text(operations: Iterable[Operation]) -> str:
  """Operations in the grammar's form: CORE, EPISODIC, SEMANTIC,
  PROCEDURAL lines (each type's lines in their order), a newline after
  every line."""
  return render(sorted(operations,
                       key=lambda op: _TYPE_ORDER[op.memory_type])) + "\n"


def canonical_response(response: ParsedResponse) -> str:
  """A valid response rewritten in the grammar's form (`canonical_text`)."""
  return canonical_text(response.operations)


def trajectories(dialogue: Dialogue, encoder: Encoder, respond: Responder,
                 memory: MemoryConfig, top_k: int, source: str,
                 fits: PromptFits | None = None
                 ) -> tuple[list[dict[str, Any]], int]:
  """Runs `respond` through `dialogue`'s sessions (each response applied
  to the bank the next session sees). The teacher answers the full
  prompt; `fits` trims only the prompt recorded for training
  (`PolicyPrompter`, its `retrieved_per_type` in the record).

  Returns:
    The JSONL records of the valid responses, and how many were rejected.
  """
  _, _, steps = build_bank(dialogue, encoder, respond, memory)
  prompter = PolicyPrompter(encoder, top_k, fits)
  records = []
  for step in steps:
    if not step.response.valid:
      continue
    messages, shown = prompter.fitted(step.bank_before, step.session)
    records.append({"dialogue_id": dialogue.dialogue_id,
                    "session_index": step.session.index, "source": source,
                    "messages": messages, "retrieved_per_type": shown,
                    "response": canonical_response(step.response)})
  return records, len(steps) - len(records)


def teacher_trajectories(dialogues: Iterable[Dialogue], encoder: Encoder,
                         responder: Callable[[Dialogue], Responder],
                         memory: MemoryConfig, top_k: int, source: str,
                         fits: PromptFits | None = None
                         ) -> tuple[list[dict[str, Any]], int]:
  """`trajectories` of every dialogue, `responder(dialogue)` the teacher
  (`annotation_responder`, `extractive_teacher(...)` or
  `endpoint_teacher(...)`); `source` names it in each record."""
  records, rejected = [], 0
  for dialogue in dialogues:
    out, bad = trajectories(dialogue, encoder, responder(dialogue), memory,
                            top_k, source, fits)
    records += out
    rejected += bad
  return records, rejected


def annotation_trajectories(dialogues: Iterable[Dialogue], encoder: Encoder,
                            memory: MemoryConfig, top_k: int,
                            fits: PromptFits | None = None
                            ) -> tuple[list[dict[str, Any]], int]:
  """Teacher = LoCoMo's observation / event_summary annotations."""
  return teacher_trajectories(dialogues, encoder, annotation_responder,
                              memory, top_k, "annotations", fits)


def extractive_teacher(response_fits: ResponseFits | None = None
                       ) -> Callable[[Dialogue], Responder]:
  """Teacher = the user's own sentences (`memory.extractive`), as many as
  `response_fits` accepts; any dataset."""
  def responder(dialogue: Dialogue) -> Responder:
    del dialogue
    def respond(bank: MemoryBank, session: Session) -> ParsedResponse:
      del bank
      return rendered_response(extractive_operations(session, response_fits))
    return respond
  return responder


def endpoint_teacher(chat: ChatModel, encoder: Encoder, top_k: int,
                     failures: collections.Counter | None = None
                     ) -> Callable[[Dialogue], Responder]:
  """Teacher = any chat model answering the policy prompt; a failed call
  is an invalid (rejected) response, counted in `failures["policy_call"]`."""
  return lambda dialogue: policy_responder(chat, encoder, top_k, failures)


def response_budget(tokenizer: Any, max_tokens: int) -> ResponseFits:
  """`ResponseFits` for canonical responses of at most `max_tokens`
  tokens, EOS included (a rollout's `max_new_tokens`)."""
  return lambda ops: len(tokenizer.encode(
      canonical_text(ops), add_special_tokens=False)) + 1 <= max_tokens


def trimmed_count(records: Sequence[dict[str, Any]], top_k: int) -> int:
  """How many records' prompts show fewer than `top_k` retrieved entries
  per type (trimmed to a token budget)."""
  return sum(r["retrieved_per_type"] < top_k for r in records)


def write_jsonl(path: str, records: Sequence[dict[str, Any]]) -> None:
  """Writes `records` as the JSONL file `path` (whole, atomically)."""
  write_atomic(path, "".join(json.dumps(r) + "\n" for r in records))


@dataclasses.dataclass(frozen=True)
class SFTConfig(Section):
  """The `sft` section: the warm start's supervised run (`run_sft`)."""

  SECTION: ClassVar[str] = "sft"

  data: str                  # The JSONL of (messages, response) records.
  batch_size: int
  micro_batches: int
  epochs: int
  max_steps: int             # 0: `epochs` decide.
  learning_rate: float
  warmup_steps: int
  weight_decay: float
  grad_clip_norm: float
  max_prompt_tokens: int
  max_response_tokens: int
  # Teacher prompts over `max_prompt_tokens` are written with fewer
  # retrieved entries.
  trim_retrieved: bool
  buckets: tuple[int, ...]   # Prompt lengths; the largest holds the longest.
  logprob_chunk: int

  def invalid(self) -> Iterator[str]:
    for name in ("batch_size", "micro_batches", "epochs",
                 "max_prompt_tokens", "max_response_tokens", "logprob_chunk"):
      yield from need(self, name, positive_int, "a positive integer")
    yield from need(self, "max_steps", lambda v: v >= 0,
                    "an int >= 0 (0: epochs decide)")
    yield from need(self, "warmup_steps", lambda v: v >= 0, ">= 0")
    yield from need(self, "learning_rate", lambda v: v > 0, "> 0")
    for name in ("weight_decay", "grad_clip_norm"):
      yield from need(self, name, lambda v: v >= 0, ">= 0")
    yield from need(self, "buckets", lambda v: len(v) > 0 and all(
        b > 0 for b in v), "positive prompt lengths")
    if self.buckets and max(self.buckets) < self.max_prompt_tokens:
      yield (f"buckets {self.buckets} must reach "
             f"sft.max_prompt_tokens={self.max_prompt_tokens}")
    problem = location_problem("data", self.data, "an existing JSONL file "
                               "(python -m tools.make_sft_data writes one)")
    if problem:
      yield problem


# What `run_sft` reads.
SFT_SECTIONS = (RunConfig, MeshConfig, PolicyConfig, SFTConfig,
                CheckpointConfig)


def _examples(path: str, tokenizer: Any, max_prompt: int, max_response: int
              ) -> tuple[list[tuple[list[int], list[int]]], int]:
  """(prompt ids, response ids + EOS) per record; too-long ones are
  dropped and counted."""
  eos = tokenizer.eos_token_id
  examples, too_long = [], 0
  with storage.path(path).open("r") as f:
    for line in f:
      if not line.strip():
        continue
      record = json.loads(line)
      prompt = encode_chat(tokenizer, record["messages"])
      response = tokenizer.encode(record["response"],
                                  add_special_tokens=False) + [eos]
      if len(prompt) > max_prompt or len(response) > max_response:
        too_long += 1
        continue
      examples.append((prompt, response))
  return examples, too_long


def run_sft(config: ml_collections.ConfigDict, workdir: str,
            echo: Callable[[str], None] | None = None
            ) -> list[dict[str, Any]]:
  """Trains (or resumes) the warm start in `workdir`; returns this run's
  metrics. The batch of step s is a pure function of s and the seed.
  `echo` (e.g. `print`) receives one line per step instead of the
  progress bar."""
  sections = validate_config(config, required=SFT_SECTIONS)
  lock = WorkdirLock(workdir, "sft")
  if jax.process_index() == 0:
    lock.acquire()
  storage.makedirs(workdir)
  if jax.process_index() == 0:
    write_config(config, workdir)
  sft, run = sections[SFTConfig], sections[RunConfig]
  checkpoint = sections[CheckpointConfig]
  return_large_blocks()  # As `loop.Trainer`: freed buffers leave the RSS.
  mesh = make_mesh(sections[MeshConfig].mesh)
  model, tokenizer = load_policy_and_tokenizer(sections[PolicyConfig])
  examples, too_long = _examples(sft.data, tokenizer, sft.max_prompt_tokens,
                                 sft.max_response_tokens)
  if too_long:
    logging.warning("%d of %d SFT examples exceed sft.max_prompt_tokens / "
                    "max_response_tokens and are skipped", too_long,
                    too_long + len(examples))
  rows = sft.batch_size
  if rows % (sft.micro_batches * batch_divisor(mesh)):
    raise ValueError(f"sft.batch_size={rows} must divide into "
                     f"{sft.micro_batches} micro-batches x "
                     f"{batch_divisor(mesh)} data shards")
  if len(examples) < rows:
    raise ValueError(f"{len(examples)} usable SFT examples < "
                     f"sft.batch_size={rows}")
  learner = Learner(model, TrainStepConfig(
      loss=SFTLossConfig(),
      optimizer=OptimizerConfig(learning_rate=sft.learning_rate,
                                warmup_steps=sft.warmup_steps,
                                weight_decay=sft.weight_decay,
                                grad_clip_norm=sft.grad_clip_norm),
      micro_batches=sft.micro_batches, logprob_chunk=sft.logprob_chunk),
                    mesh)
  steps_per_epoch = len(examples) // rows
  total = sft.max_steps or sft.epochs * steps_per_epoch
  checkpointer = Checkpointer.for_workdir(workdir, checkpoint)
  key = jax.random.key(run.seed)
  restored = checkpointer.restore(learner.params, learner.opt_state, key)
  step = 0
  if restored is not None:
    learner.params, learner.opt_state = restored.params, restored.opt_state
    step = restored.step
  buckets = tuple(sft.buckets)
  pad = int(tokenizer.pad_token_id or 0)
  writer = MetricsWriter(workdir, total, tensorboard=run.tensorboard,
                         start_step=step, progress=False if echo else None)
  history = []

  def save(epoch: int) -> None:
    if step not in checkpointer.steps():
      checkpointer.save(step, learner.params, learner.opt_state, key,
                        {"epoch": epoch})

  with contextlib.ExitStack() as stack:
    stack.callback(lock.release)  # Last: once everything is written.
    stack.callback(writer.close)
    stack.enter_context(metrics_follow_checkpoints(checkpointer, writer))
    stack.callback(checkpointer.wait)
    stop = stack.enter_context(StopSignals())
    while step < total:
      epoch, position = divmod(step, steps_per_epoch)
      if stop.requested(step, checkpointer.manager):
        save(epoch)
        checkpointer.wait()
        raise Interrupted(stop.message(step), stop.signum)
      order = np.random.default_rng([run.seed, epoch]).permutation(
          len(examples))
      chosen = [examples[i] for i in order[position * rows:
                                           (position + 1) * rows]]
      start = time.perf_counter()
      batch = supervised_batch(
          [p for p, _ in chosen], [r for _, r in chosen],
          bucket_length(max(len(p) for p, _ in chosen), buckets),
          sft.max_response_tokens, pad)
      metrics = learner.step(batch)
      step += 1
      metrics.update(epoch=epoch, skipped_examples=too_long,
                     wall_s=time.perf_counter() - start)
      writer.write(step, metrics)
      history.append(metrics)
      if echo:
        echo(f"warm start step {step}/{total}: nll {metrics['nll']:.4f} "
             f"({metrics['wall_s']:.1f} s)")
      if step % checkpoint.every_steps == 0 or step == total:
        save(epoch)
  return history


def summary_line(history: Sequence[dict[str, Any]], workdir: str) -> str:
  """The warm start's NLL from its first to its last step, and how GRPO
  starts from it."""
  if not history:
    return f"no warm start steps in {workdir}"
  first, last = history[0], history[-1]
  return (f"warm start: nll {first['nll']:.4f} (step {first['step']}) -> "
          f"{last['nll']:.4f} (step {last['step']}); GRPO from it: "
          f"--config.policy.init_checkpoint={workdir}")
