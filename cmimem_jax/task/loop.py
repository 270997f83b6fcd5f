"""The CMI-Mem training loop: what one GRPO step of CMI-Mem does (SPEC §5;
paper §3.4, Alg. 1, Table 7).

Each step: a curriculum batch of sessions (Eq. 14) -> the policy prompt of
each (Listings 6-7, top-k retrieved memories from its snapshot M_{t-1})
-> N sampled DSL responses per session -> parse -> apply to a copy of the
state -> CMI terms (one batched kernel call) + QA reward (`context_recall`
or an LLM judge) -> composite reward, validity gate, attribution token
weights -> group advantages -> one sharded GRPO update (`rl.Learner`).
Every reward term is logged per step to `DIR/metrics.jsonl` (and
TensorBoard); with `rl.log_rollouts`, every rollout's response and terms
to `DIR/rollouts.jsonl`.

Snapshots M_{t-1} (`rl.snapshots`): fixed expert states from a directory
(the paper's protocol; `tools/build_expert_states.py` builds them), never
rebuilt; or ("policy") built by the initial policy (greedy), cached under
`DIR/snapshots/v<N>/`, and rebuilt by the current policy every
`rl.snapshot_refresh_epochs` epochs. Checkpoints (params, optimizer, RNG,
step = curriculum position, snapshot version) go to `DIR/checkpoints/`;
a rerun with the same DIR resumes from the newest readable one.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import time
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import jax
import ml_collections
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from cmimem_jax import storage
from cmimem_jax.cmi.logprob import PolicyProfileLM
from cmimem_jax.config import (Interrupted, Section, Sections,
                               check_failures, location_problem, need,
                               positive_int, unchecked, validate_config,
                               write_config)
from cmimem_jax.data import (DatasetConfig, Dialogue, WorkdirLock,
                             load_configured)
from cmimem_jax.data.files import write_atomic
from cmimem_jax.encoders import (Encoder, EncoderConfig, encoder_identity,
                                 make_encoder)
from cmimem_jax.memory.builder import EDIT_COUNTERS, MemoryConfig
from cmimem_jax.memory.compression import memory_editors
from cmimem_jax.memory.dsl import response_regex
from cmimem_jax.memory.prompt_builder import PolicyPrompter
from cmimem_jax.models.host_memory import (release_free_heap,
                                          return_large_blocks)
from cmimem_jax.models.qwen3.params import save_hf
from cmimem_jax.parallel import MeshConfig, initialize_distributed, make_mesh
from cmimem_jax.models.qwen3 import Qwen3
from cmimem_jax.rl import (CheckpointConfig, Checkpointer, GRPOLossConfig,
                           GRPOStep, Learner, MetricsWriter, OptimizerConfig,
                           Rollouts, RolloutSettings, Scores,
                           StopSignals, TrainStepConfig, load_model_weights,
                           read_metrics)
from cmimem_jax.rl.checkpoint import metrics_follow_checkpoints
from cmimem_jax.sampling import (ChatPolicy, PolicyConfig, TokenConstraint,
                                 load_policy_and_tokenizer, special_ids)
from cmimem_jax.sampling.sampler import DECODE_DEVICES
from cmimem_jax.sampling.vllm_engine import (VLLMEngine, checkpoint_dir,
                                             import_vllm)
from cmimem_jax.task.curriculum import (Curriculum, SessionRef,
                                        candidate_fragments, difficulty)
from cmimem_jax.task.episode import (Episode, RolloutScorer,
                                     attribution_weights, score_rollouts,
                                     session_questions)
from cmimem_jax.task.qa_reward import QAConfig, QAReward
from cmimem_jax.task.report import session_line, summary_text, written_memory
from cmimem_jax.task.reward import (NO_EXPERT_RESPONSE, RewardComputer,
                                    RewardConfig)
from cmimem_jax.task.skip_table import calibrated
from cmimem_jax.task.snapshots import (build_snapshots, expert_responses,
                                       load_expert_snapshots, load_snapshots,
                                       save_snapshots)


ROLLOUT_ENGINES = ("jax", "vllm")


@dataclasses.dataclass(frozen=True)
class RolloutConfig(Section):
  """The `rollout` section: how the GRPO step samples its rollouts."""

  SECTION: ClassVar[str] = "rollout"

  engine: str                    # One of ROLLOUT_ENGINES.
  num_rollouts: int              # G: the group of one session.
  temperature: float
  top_p: float
  max_new_tokens: int
  max_prompt_tokens: int
  # Prompts are left-padded to these (ascending; the largest must hold
  # `max_prompt_tokens`, or a valid prompt is refused mid-run). vLLM may
  # take none: its rows then reach the learner padded to the batch's
  # longest prompt (a train step compiled per length).
  buckets: tuple[int, ...]
  max_rows_per_wave: int         # 0: every row in one wave.
  decode_devices: str            # One of DECODE_DEVICES.
  release_programs_each_step: bool
  score_beside_decoding: bool
  retrieval_top_k: int           # Entries per type in the policy prompt.
  constrained_dsl: bool          # The JAX decode loop keeps to the DSL.
  vllm: dict[str, Any] | None = None  # `VLLMEngine` keyword arguments.

  def invalid(self) -> Iterator[str]:
    yield from need(self, "engine", lambda v: v in ROLLOUT_ENGINES,
                    "jax or vllm")
    if self.constrained_dsl and self.engine == "vllm":
      yield ("constrained_dsl needs rollout.engine='jax' (the constraint "
             "runs inside the JAX decode loop)")
    yield from need(self, "num_rollouts", lambda v: v >= 2,
                    "an int >= 2 (GRPO compares rollouts within a group)")
    yield from need(self, "temperature", lambda v: v >= 0, ">= 0")
    yield from need(self, "top_p", lambda v: 0 < v <= 1, "in (0, 1]")
    yield from need(self, "max_rows_per_wave", lambda v: v >= 0,
                    "a non-negative integer")
    yield from need(self, "decode_devices", lambda v: v in DECODE_DEVICES,
                    f"one of {DECODE_DEVICES}: decode on one device, or "
                    "split the rows over the mesh's batch axes")
    for key in ("max_new_tokens", "max_prompt_tokens", "retrieval_top_k"):
      yield from need(self, key, positive_int, "a positive integer")
    buckets = self.buckets
    if not all(b > 0 for b in buckets) or list(buckets) != sorted(
        set(buckets)):
      yield f"buckets={buckets!r}: must be ascending positive token counts"
    elif not buckets:
      if self.engine != "vllm":
        yield ("buckets=(): the JAX engine needs buckets (one compiled "
               "sampler per bucket)")
    elif buckets[-1] < self.max_prompt_tokens:
      yield (f"buckets={buckets}: the largest must hold "
             f"rollout.max_prompt_tokens={self.max_prompt_tokens}")


@dataclasses.dataclass(frozen=True)
class RLConfig(Section):
  """The `rl` section: the GRPO run (Table 7): batches, the curriculum,
  the objective (`loss_config`), the optimizer, the snapshots M_{t-1}."""

  SECTION: ClassVar[str] = "rl"

  sessions_per_batch: int
  epochs: int
  max_steps: int                 # 0: the curriculum's planned steps.
  micro_batches: int
  learning_rate: float
  warmup_steps: int
  grad_clip_norm: float
  weight_decay: float
  kl_beta: float
  epsilon_low: float
  epsilon_high: float
  clip_ratio_c: float
  kl_clamp: float
  log_ratio_clamp: float
  loss_aggregation: str
  # The train step makes one optimizer update per step, so the learner's
  # start-of-step log-probs are π_old ("learner", verl's on-policy path);
  # a loop of several updates on one batch must take "sampler".
  old_logprobs: str
  logprob_chunk: int
  share_prompts: bool
  snapshots: str                 # "policy" or a directory of expert states.
  snapshot_refresh_epochs: int
  curriculum_weights: tuple[float, ...]
  curriculum_tiers: int
  validation_sessions: int
  eval_every: int
  log_rollouts: bool

  def loss_config(self) -> GRPOLossConfig:
    """The GRPO objective of this section."""
    return GRPOLossConfig(**self._loss_values())

  def _loss_values(self) -> dict[str, Any]:
    return dict(epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high,
                kl_beta=self.kl_beta, aggregation=self.loss_aggregation,
                clip_ratio_c=self.clip_ratio_c,
                log_ratio_clamp=self.log_ratio_clamp, kl_clamp=self.kl_clamp,
                old_logprobs=self.old_logprobs)

  def invalid(self) -> Iterator[str]:
    for key in ("sessions_per_batch", "micro_batches", "curriculum_tiers",
                "logprob_chunk"):
      yield from need(self, key, positive_int, "a positive integer")
    yield from need(self, "learning_rate", lambda v: v > 0, "> 0")
    for key in ("weight_decay", "grad_clip_norm"):
      yield from need(self, key, lambda v: v >= 0, ">= 0")
    for key in ("max_steps", "warmup_steps", "epochs", "validation_sessions",
                "eval_every", "snapshot_refresh_epochs"):
      yield from need(self, key, lambda v: v >= 0, "an integer >= 0")
    yield from need(self, "curriculum_weights", lambda v: len(v) == 3 and all(
        w >= 0 for w in v), "three finite weights >= 0")
    # The objective's own rules (`GRPOLossConfig.invalid`), one set for
    # the config and the code.
    for line in unchecked(GRPOLossConfig, **self._loss_values()).invalid():
      yield ("loss_" + line) if line.startswith("aggregation") else line
    if self.snapshots != "policy":
      problem = location_problem(
          "snapshots", self.snapshots, "'policy' or a directory of expert "
          "states (python -m tools.build_expert_states)", directory=True)
      if problem:
        yield problem
    if self.sessions_per_batch < self.curriculum_tiers:
      yield (f"sessions_per_batch={self.sessions_per_batch} must be >= "
             f"rl.curriculum_tiers={self.curriculum_tiers} (every batch "
             "draws from every tier)")

  def invalid_with(self, sections: Sections) -> Iterator[str]:
    rollout, mesh = sections.get(RolloutConfig), sections.get(MeshConfig)
    if rollout is None or mesh is None:
      return
    shards, rollouts = mesh.batch_shards, rollout.num_rollouts
    rows = rollouts * self.sessions_per_batch
    if rows % (self.micro_batches * shards):
      yield (f"rollout rows {self.sessions_per_batch} sessions x {rollouts} "
             f"rollouts = {rows} must divide into rl.micro_batches="
             f"{self.micro_batches} x {shards} data shards of mesh "
             f"{mesh.mesh!r}")
    wave = rollout.max_rows_per_wave
    if (rollout.decode_devices == "mesh" and rollout.engine == "jax"
        and wave % (rollouts * shards)):
      yield (f"rollout.max_rows_per_wave={wave} must be whole groups of "
             f"{rollouts} rollouts x {shards} batch shards of mesh "
             f"{mesh.mesh!r} (rollout.decode_devices='mesh': every chip "
             "decodes its share of every wave)")


@dataclasses.dataclass(frozen=True)
class RunConfig(Section):
  """The training job's top-level fields."""

  seed: int          # Sessions held out, rollouts' keys, the random policy.
  tensorboard: bool  # Metrics also as TensorBoard events.


# What `grpo_step` reads.
GRPO_STEP_SECTIONS = (RolloutConfig, RLConfig, RewardConfig)
# What `Trainer` reads (`train` validates them before anything loads).
TRAINING_SECTIONS = (RunConfig, MeshConfig, DatasetConfig, EncoderConfig,
                     MemoryConfig, RewardConfig, PolicyConfig, RolloutConfig,
                     RLConfig, QAConfig, CheckpointConfig)


@dataclasses.dataclass
class LoopState:
  """Where a training run is, saved in each checkpoint (as the JSON
  object of these fields: the keys older checkpoints hold)."""

  step: int = 0              # Steps done = the curriculum's position.
  snapshot_version: int = 0  # `DIR/snapshots/v<N>/` of policy snapshots.
  snapshot_epoch: int = 0    # The epoch that built that version.

  @classmethod
  def from_saved(cls, saved: dict[str, Any]) -> LoopState:
    """From a checkpoint's JSON loop state (a key it lacks keeps its
    default; one this version does not know is refused)."""
    unknown = set(saved) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
      raise ValueError(f"checkpoint loop state has unknown keys "
                       f"{sorted(unknown)}")
    return cls(**saved)


def train_step_config(rl: RLConfig, rollout: RolloutConfig,
                      constraint: TokenConstraint | None) -> TrainStepConfig:
  """The learner's step of a training config: the `rl` section's
  objective (`RLConfig.loss_config`), optimizer and micro-batching, the
  rollouts' temperature, and the constraint's EOS when rollouts are
  grammar-constrained."""
  return TrainStepConfig(
      loss=rl.loss_config(),
      optimizer=OptimizerConfig(
          learning_rate=rl.learning_rate, warmup_steps=rl.warmup_steps,
          weight_decay=rl.weight_decay, grad_clip_norm=rl.grad_clip_norm),
      micro_batches=rl.micro_batches,
      temperature=rollout.temperature,
      logprob_chunk=rl.logprob_chunk, share_prompts=rl.share_prompts,
      constraint_eos_id=None if constraint is None else constraint.eos_id)


def rollout_settings(rollout: RolloutConfig, rl: RLConfig
                     ) -> RolloutSettings:
  """How a training config's GRPO step samples (`rl.step.GRPOStep`)."""
  return RolloutSettings(
      group=rollout.num_rollouts, temperature=rollout.temperature,
      top_p=rollout.top_p, max_new_tokens=rollout.max_new_tokens,
      logprob_chunk=rl.logprob_chunk,
      release_programs_each_step=rollout.release_programs_each_step,
      score_beside_decoding=rollout.score_beside_decoding)


def jax_policy(rollout: RolloutConfig, model: Qwen3, tokenizer: Any,
               mesh: Mesh, constraint: TokenConstraint | None) -> ChatPolicy:
  """The rollout policy of a training config on the JAX engine: the
  `Sampler` over `model` (the learner's weights; abstract ones for
  `tools/plan.py`), decoding on `rollout.decode_devices` of `mesh` in
  waves of `rollout.max_rows_per_wave`."""
  return ChatPolicy.jax(model, tokenizer, rollout.max_prompt_tokens,
                        tuple(rollout.buckets), mesh, constraint=constraint,
                        max_rows_per_wave=rollout.max_rows_per_wave,
                        decode_devices=rollout.decode_devices)


def grpo_step(sections: Sections, model: Qwen3, tokenizer: Any, mesh: Mesh,
              workdir: str = "") -> GRPOStep:
  """The GRPO step of a training config (its `GRPO_STEP_SECTIONS`) as
  `Trainer` runs it: the learner of `model` (`train_step_config`, the KL /
  App. E reference), the rollout engine (`jax_policy`, or vLLM over an HF
  copy of the weights in `workdir`), the grammar constraint when
  `rollout.constrained_dsl`. `model` may be abstract (`abstract_model`):
  then nothing is placed and the step only lowers its programs
  (`tools/plan.py`)."""
  rollout, rl = sections[RolloutConfig], sections[RLConfig]
  # Grammar-constrained rollouts: every response is valid DSL, and the
  # learner takes its log-probs under the same mask.
  constraint = (TokenConstraint.from_regex(response_regex(), tokenizer)
                if rollout.constrained_dsl else None)
  min_budget = None
  if constraint is not None:
    vocab = model.config.vocab_size
    # The sampler's own device copy where it decodes on the whole mesh
    # (`TokenConstraint.device_table`); never `next_state`, which only
    # the sampler reads (decoding on one device, a copy replicated over
    # the mesh would be 40 MB per device).
    min_budget = (constraint.padded_table("min_budget", vocab)
                  if _is_abstract(model) else constraint.device_table(
                      "min_budget", vocab, NamedSharding(mesh, P())))
  learner = Learner(model, train_step_config(rl, rollout, constraint), mesh,
                    min_budget=min_budget,
                    keep_reference=sections[RewardConfig].estimator
                    == "logprob")
  if rollout.engine == "vllm":
    directory = checkpoint_dir(workdir)
    save_hf(learner.model, directory)
    eos_ids, pad_id = special_ids(tokenizer)
    policy = ChatPolicy(
        VLLMEngine(directory, eos_ids, pad_id, tuple(rollout.buckets),
                   **(rollout.vllm or {})),
        tokenizer, rollout.max_prompt_tokens)
  else:
    policy = jax_policy(rollout, learner.model, tokenizer, mesh, constraint)
  return GRPOStep(learner, policy, rollout_settings(rollout, rl), constraint)


def rollout_prompter(rollout: RolloutConfig, encoder: Encoder,
                     policy: ChatPolicy) -> PolicyPrompter:
  """The policy's prompt in training (rollouts, validation, policy-built
  snapshots, the demo's responses): `rollout.retrieval_top_k` entries per
  type, trimmed to the policy's prompt budget (`rollout.max_prompt_tokens`)
  as evaluation's `policy` builder trims to its model's."""
  return PolicyPrompter(encoder, rollout.retrieval_top_k, policy.prompt_fits)


def _is_abstract(model: Qwen3) -> bool:
  return any(isinstance(x, jax.ShapeDtypeStruct)
             for x in jax.tree.leaves(nnx.state(model)))


def training_dialogues(dataset: DatasetConfig) -> list[Dialogue]:
  """The dialogues a training job reads from its `dataset` section (its
  split, the first `dialogues` of them; 0 = all)."""
  return load_configured(dataset, "train")[:dataset.dialogues or None]


def split_validation(sessions: list[SessionRef], count: int, seed: int
                     ) -> tuple[list[SessionRef], list[SessionRef]]:
  """(`count` held-out sessions drawn with `seed`, the others in order)."""
  if count < 0 or count >= len(sessions):
    raise ValueError(f"rl.validation_sessions={count} must be in [0, "
                     f"{len(sessions)}) (the training sessions)")
  chosen = set(np.random.default_rng(seed).choice(len(sessions), count,
                                                  replace=False).tolist())
  return ([s for i, s in enumerate(sessions) if i in chosen],
          [s for i, s in enumerate(sessions) if i not in chosen])


def _training_sessions(dialogues: list[Dialogue], weights) -> list[SessionRef]:
  refs = []
  for d, dialogue in enumerate(dialogues):
    for session in dialogue.sessions:
      questions = session_questions(dialogue, session)
      if questions:  # Sessions without QA pairs give no QA reward.
        fragments = candidate_fragments([t.text for t in session.turns])
        refs.append(SessionRef(d, session.index, difficulty(
            session.index, fragments, len(questions), weights)))
  return refs


def plan_sessions(rl: RLConfig, seed: int, dialogues: list[Dialogue]
                  ) -> tuple[list[SessionRef], Curriculum]:
  """(the held-out validation sessions, the curriculum of the others): what
  a training config trains on, from its `rl` section and `seed` alone (no
  model), as `Trainer` plans it."""
  sessions = _training_sessions(dialogues, tuple(rl.curriculum_weights))
  # Held-out sessions, fixed by the seed, never in a training batch: the
  # validation curve (`rl.eval_every`).
  validation, sessions = split_validation(sessions, rl.validation_sessions,
                                          seed)
  return validation, Curriculum(sessions, rl.sessions_per_batch,
                                rl.curriculum_tiers, max(1, rl.epochs))


def _mean_terms(terms) -> dict[str, float]:
  sums: dict[str, list[float]] = collections.defaultdict(list)
  for t in terms:
    for name, value in t.scalars().items():
      sums[name].append(value)
  return {f"reward/{k}": float(np.mean(v)) for k, v in sums.items()}


def scoring_needs_device(encoder: Encoder, memory: MemoryConfig) -> bool:
  """Whether scoring a wave runs programs on the chips
  (`rl.IncrementalReward.needs_device`): an in-process encoder embeds the
  new entries and the questions (`Encoder.on_device`; an encoder that
  does not say counts as one), or the policy compresses the core or
  writes MERGE summaries (`memory.compressor` / `merge_summarizer`). The
  step then dispatches the next wave after the scoring's programs, so
  they never wait behind a whole wave's decoding."""
  return bool(getattr(encoder, "on_device", True)) or "policy" in (
      memory.compressor, memory.merge_summarizer)


class SessionReward:
  """A step's `rl.IncrementalReward` for `group` rollouts of each of
  `episodes`: each wave's responses parsed, applied to a copy of their
  session's snapshot and their QA calls sent as the wave arrives
  (`RolloutScorer.add`); `finish` waits for the calls, scores every row
  (CMI terms + QA reward) and adds the attribution token weights. Its
  metrics are the mean reward terms (`reward/*`), the QA endpoint
  failures and the model edits of the step; `Scores.details`: each
  rollout's `RewardTerms`. A step whose QA calls failed past
  `qa.max_failure_rate` raises in `finish`, before the update."""

  def __init__(self, trainer: Trainer, episodes: list[Episode]):
    self.trainer, self.episodes = trainer, episodes
    self.needs_device = trainer.scoring_needs_device
    self.failures_before = sum(trainer.qa.failures.values())
    self.edits: collections.Counter[str] = collections.Counter()
    self.scorer = RolloutScorer(trainer.encoder, trainer.memory,
                                trainer.qa, trainer.reward, trainer.editors,
                                self.edits)
    self.rows = 0  # Rows added so far.

  def add(self, wave: Rollouts) -> None:
    first = self.rows // wave.group
    sessions = len(wave.texts) // wave.group
    self.scorer.add(self.episodes[first:first + sessions], wave.texts,
                    wave.group)
    self.rows += len(wave.texts)

  def finish(self, rollouts: Rollouts) -> Scores:
    trainer = self.trainer
    if self.rows != len(rollouts.texts):
      raise ValueError(f"{self.rows} rollouts scored of the step's "
                       f"{len(rollouts.texts)}")
    _, terms = self.scorer.finish()
    failures = sum(trainer.qa.failures.values()) - self.failures_before
    # Before the update: a step whose QA calls failed past the accepted
    # rate is not trained on.
    trainer._check_qa_failures(trainer.loop.step + 1, self.episodes,
                               terms, self.failures_before)
    width = rollouts.output.tokens.shape[1]
    weights = np.stack([
        attribution_weights(t, trainer.policy.decode, c, width,
                            trainer.policy.decode_each)
        for t, c in zip(terms, rollouts.completions)])
    return Scores(
        np.array([t.reward for t in terms]),
        np.array([t.valid for t in terms]), weights,
        {**_mean_terms(terms), "qa_failures": failures,
         **{key: self.edits[key] for key in EDIT_COUNTERS}},
        terms)


class Trainer:
  """The CMI-Mem training loop around the GRPO `Learner`; rollouts come
  from `self.policy` (a `ChatPolicy` over the JAX sampler or vLLM)."""

  def __init__(self, config: ml_collections.ConfigDict, workdir: str):
    sections = validate_config(config, required=TRAINING_SECTIONS)
    self.run_config = sections[RunConfig]
    self.rollout, self.rl = sections[RolloutConfig], sections[RLConfig]
    self.memory = sections[MemoryConfig]
    encoder_config = sections[EncoderConfig]
    self.policy_config = policy_config = sections[PolicyConfig]
    if self.rollout.engine == "vllm":
      import_vllm()  # Fails fast, with the install hint, where it is absent.
    # The Semantic SKIP thresholds of this encoder (refused before anything
    # loads when it has none: tools/skip_calibration.py first).
    reward_config = calibrated(sections[RewardConfig], encoder_config)
    # Freed step / decode buffers leave the resident set at once (a JAX
    # CPU device's memory is this process's heap).
    return_large_blocks()
    initialize_distributed()
    self.config, self.workdir = config, workdir
    # What can refuse the inputs (the mesh, the dataset, the held-out
    # split) runs before the workdir exists: a refused run leaves none.
    self.mesh = make_mesh(sections[MeshConfig].mesh)
    self.dialogues = training_dialogues(sections[DatasetConfig])
    self.validation, self.curriculum = plan_sessions(
        self.rl, self.run_config.seed, self.dialogues)
    # One writer per workdir (process 0 writes for a multi-host job).
    self.lock = WorkdirLock(workdir, "train")
    if jax.process_index() == 0:
      self.lock.acquire()
    storage.makedirs(workdir)
    if jax.process_index() == 0:
      write_config(config, workdir)
    self.encoder = make_encoder(encoder_config)
    model, tokenizer = load_policy_and_tokenizer(policy_config)
    if policy_config.init_checkpoint:  # The KL reference starts here too.
      load_model_weights(model, policy_config.init_checkpoint)
    needed = self.rollout.max_prompt_tokens + self.rollout.max_new_tokens
    if needed > model.config.max_position_embeddings:
      raise ValueError(
          f"rollout.max_prompt_tokens + max_new_tokens = {needed} exceeds the "
          f"policy's max_position_embeddings "
          f"{model.config.max_position_embeddings}")
    self.group = self.rollout.num_rollouts
    self.grpo = grpo_step(sections, model, tokenizer, self.mesh, workdir)
    self.learner, self.policy = self.grpo.learner, self.grpo.policy
    self.prompter = rollout_prompter(self.rollout, self.encoder, self.policy)
    self.constraint = self.grpo.constraint
    self.total_steps = self.rl.max_steps or self.curriculum.planned_steps
    self.checkpoint_config = sections[CheckpointConfig]
    self.checkpointer = Checkpointer.for_workdir(workdir,
                                                 self.checkpoint_config)
    self.key = jax.random.key(self.run_config.seed)
    self.loop = LoopState()
    # The last step's rollouts, one record each (with `rl.log_rollouts`).
    self.rollout_records: list[dict[str, Any]] = []
    restored = self.checkpointer.restore(self.learner.params,
                                         self.learner.opt_state, self.key)
    if restored is not None:
      self.learner.params = restored.params
      self.learner.opt_state = restored.opt_state
      self.key = restored.rng
      self.loop = LoopState.from_saved(restored.loop_state)
      self.policy.set_model(self.learner.model)
      logging.info("resumed from step %d (skipped unreadable: %s)",
                   restored.step, restored.skipped)
    self.resumed_from = None if restored is None else restored.step
    profile_lm = None
    if reward_config.estimator == "logprob":
      # App. E / H.3: p_ref is the frozen initial policy (the KL
      # reference), never the live one: it writes the Listing 8 profiles
      # (JAX sampler, free text) and scores them.
      reference = self.learner.reference_model
      profile_lm = PolicyProfileLM(
          ChatPolicy.jax(reference, tokenizer,
                         self.rollout.max_prompt_tokens,
                         tuple(self.rollout.buckets), self.mesh,
                         decode_devices=self.rollout.decode_devices),
          lambda: reference, reward_config.profile_max_new_tokens,
          self.rl.logprob_chunk)
    self.reward = RewardComputer(self.encoder, reward_config, profile_lm)
    self.qa_config = sections[QAConfig]
    self.qa = QAReward.from_config(self.qa_config, self.memory, self.encoder)
    self.editors = memory_editors(
        self.memory, {"policy": self.policy, "answer": self.qa.answerer})
    self.scoring_needs_device = scoring_needs_device(self.encoder,
                                                     self.memory)
    self.fixed_snapshots = self.rl.snapshots != "policy"
    if self.fixed_snapshots:
      self.snapshots = load_expert_snapshots(
          self.rl.snapshots, self.dialogues, encoder_identity(encoder_config))
    else:
      self.snapshots = self._snapshots(self.loop.snapshot_version)
    # The teacher's responses (fixed expert states only): the length
    # penalty's reference (`reward.length_reference`).
    self.expert = (expert_responses(self.rl.snapshots)
                   if self.fixed_snapshots else {})

  # -- snapshots -------------------------------------------------------------

  def _respond(self, conversations):
    return self.policy.respond(conversations, self.rollout.max_new_tokens)

  def _snapshots(self, version: int):
    directory = storage.join(self.workdir, "snapshots", f"v{version}")
    banks = load_snapshots(directory, self.dialogues)
    if banks is None:
      start = time.perf_counter()
      banks = build_snapshots(self.dialogues, self._respond, self.prompter,
                              self.encoder, self.memory, self.editors)
      save_snapshots(directory, banks)
      logging.info("built snapshots v%d in %.1f s", version,
                   time.perf_counter() - start)
    return banks

  def episode(self, ref: SessionRef) -> Episode:
    dialogue = self.dialogues[ref.dialogue]
    session = dialogue.sessions[ref.session]
    return Episode(dialogue, session, self.snapshots[ref.dialogue][ref.session],
                   session_questions(dialogue, session),
                   self.expert.get((dialogue.dialogue_id, ref.session),
                                   NO_EXPERT_RESPONSE)
                   if self.fixed_snapshots else None)

  def validate(self) -> dict[str, float]:
    """The held-out sessions answered greedily and scored with the full
    reward: `eval/*` metrics (mean over the sessions)."""
    episodes = [self.episode(r) for r in self.validation]
    texts = self._respond([self.prompter(e.bank, e.session)
                           for e in episodes])
    _, terms = score_rollouts(episodes, texts, 1, self.encoder,
                              self.memory, self.qa, self.reward,
                              self.editors)
    return {"eval/reward": float(np.mean([t.reward for t in terms])),
            "eval/qa": float(np.mean([t.qa for t in terms])),
            "eval/cmi": float(np.mean([t.cmi for t in terms])),
            "eval/validity": float(np.mean([t.valid for t in terms])),
            "eval/response_chars": float(np.mean([len(t) for t in texts])),
            "eval/sessions": len(episodes)}

  def greedy_response(self, ref: SessionRef) -> str:
    episode = self.episode(ref)
    return self._respond([self.prompter(episode.bank, episode.session)])[0]

  # -- one step --------------------------------------------------------------

  def step(self) -> dict[str, Any]:
    step = self.loop.step
    epoch = self.curriculum.epoch(step)
    refresh = self.rl.snapshot_refresh_epochs
    if not self.fixed_snapshots and refresh and epoch > 0 and (
        epoch % refresh == 0) and self.loop.snapshot_epoch != epoch:
      self.loop.snapshot_version += 1
      self.loop.snapshot_epoch = epoch
      self.snapshots = self._snapshots(self.loop.snapshot_version)
    # An asynchronous checkpoint save that finished since the last step
    # left its host copies' blocks in the heap (`Checkpointer.wait`).
    release_free_heap()
    refs = self.curriculum.batch(step)
    episodes = [self.episode(r) for r in refs]
    prompts = [self.policy.encode(self.prompter(e.bank, e.session))
               for e in episodes]
    self.key, key = jax.random.split(self.key)
    result = self.grpo(prompts, key, self.session_reward(episodes))
    metrics = result.metrics
    metrics.update(
        epoch=epoch, snapshot_version=self.loop.snapshot_version,
        sessions=[f"{self.dialogues[r.dialogue].dialogue_id}/{r.session}"
                  for r in refs])
    terms, texts = result.scores.details, result.rollouts.texts
    self.rollout_records = [] if not self.rl.log_rollouts else [
        {"session": metrics["sessions"][i // self.group],
         "session_id": episodes[i // self.group].session.session_id,
         "rollout": i % self.group, "advantage": float(result.advantages[i]),
         **t.scalars(),
         "semantic_skip_statement_cosines": (
             t.semantic_skip_statement_cosines),
         "response": text}
        for i, (t, text) in enumerate(zip(terms, texts))]
    self.loop.step = step + 1
    return metrics

  def _check_qa_failures(self, step: int, episodes: list[Episode],
                         terms: list[Any], failures_before: int) -> None:
    """Raises `config.CallsFailed` (before the step's update: the newest
    checkpoint stays the run's state) when more of this step's QA
    questions went unjudged (failed calls) than `qa.max_failure_rate`
    accepts. Only valid rollouts' banks are asked their questions."""
    failed = sum(self.qa.failures.values()) - failures_before
    if failed:
      qa = self.qa_config
      asked = sum(len(episodes[row // self.group].questions)
                  for row, t in enumerate(terms) if t.valid)
      check_failures(
          failed, asked,
          qa.max_failure_rate,
          f"QA questions of step {step} could not be judged (answer "
          f"{qa.answer.base_url}, judge {qa.judge_endpoint.base_url})",
          "no update made from them: rerun to resume from the last "
          "checkpoint")

  def session_reward(self, episodes: list[Episode]) -> SessionReward:
    """The step's reward for `group` rollouts of each of `episodes`
    (`SessionReward`)."""
    return SessionReward(self, episodes)

  def save_checkpoint(self) -> None:
    step = self.loop.step
    if step not in self.checkpointer.steps():
      self.checkpointer.save(step, self.learner.params,
                             self.learner.opt_state, self.key,
                             dataclasses.asdict(self.loop))

  def run(self, stop: StopSignals | None = None,
          echo: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Trains to `total_steps`, checkpointing; returns this run's metrics.
    `echo` (e.g. `print`) receives a line as the first step begins and
    one per step, instead of the progress bar.

    SIGTERM / SIGINT (`stop`, or signals watched here) end the run at the
    next step boundary with a checkpoint and `config.Interrupted`.
    """
    writer = MetricsWriter(self.workdir, self.total_steps,
                           tensorboard=self.run_config.tensorboard,
                           start_step=self.loop.step,
                           progress=False if echo else None,
                           rollouts=self.rl.log_rollouts)
    every = self.checkpoint_config.every_steps
    history = []
    with contextlib.ExitStack() as stack:
      stack.callback(writer.close)
      # A failed save cuts the metrics back to the last saved step.
      stack.enter_context(metrics_follow_checkpoints(self.checkpointer,
                                                     writer))
      stack.callback(self.checkpointer.wait)
      stop = stop or stack.enter_context(StopSignals())
      # The start-up's programs (one prompt at a time) are not the step's.
      self.policy.engine.release(programs=True)
      # Printed once the writer is open (tensorboardX's import takes
      # seconds): a signal after this line stops the run at the end of
      # the step it lands in (tools/rehearse.py relies on it).
      if echo:
        resumed = (f" (resumed from {self.resumed_from})"
                   if self.resumed_from else "")
        echo(f"training: steps {self.loop.step + 1}..{self.total_steps}"
             + resumed if self.loop.step < self.total_steps else
             f"training: steps done, all {self.total_steps}{resumed}")
      while self.loop.step < self.total_steps:
        if stop.requested(self.loop.step, self.checkpointer.manager):
          self.save_checkpoint()
          self.checkpointer.wait()
          raise Interrupted(stop.message(self.loop.step), stop.signum)
        metrics = self.step()
        step = self.loop.step
        eval_every = self.rl.eval_every
        if self.validation and eval_every and (step % eval_every == 0
                                               or step == self.total_steps):
          metrics.update(self.validate())
        writer.write(step, metrics)
        if self.rl.log_rollouts:
          writer.write_rollouts(step, self.rollout_records)
        history.append(metrics)
        line = (f"step {step}/{self.total_steps}: reward "
                f"{metrics['reward_mean']:.4f} valid "
                f"{metrics['validity_rate']:.2f} loss "
                f"{metrics.get('loss', float('nan')):.4g} "
                f"({metrics['step_time_s']:.1f} s)")
        if echo:
          echo(line)
        logging.info(line)
        if step % every == 0 or step == self.total_steps:
          self.save_checkpoint()
    return history


def train(config: ml_collections.ConfigDict, workdir: str,
          echo: Callable[[str], None] | None = None) -> str:
  """Trains (or resumes) in `workdir`; returns the human-readable report:
  the reward table over every step so far, one session's memory written
  by the initial and by the trained policy, and a JSON line of run facts.
  `echo` receives one progress line per stage and step.

  Raises:
    config.Interrupted: SIGTERM / SIGINT (also while starting up): a
      checkpoint of the last finished step is saved first.
  """
  echo = echo or (lambda line: None)
  start = time.perf_counter()
  with StopSignals() as stop:
    echo("loading the policy, the encoder and the data ...")
    loop = Trainer(config, workdir)
    demo_ref = loop.curriculum.batch(0)[0]
    demo = loop.episode(demo_ref)
    demo_session = (f"{loop.dialogues[demo_ref.dialogue].dialogue_id}/"
                    f"{demo_ref.session}")
    before_path = storage.path(storage.join(workdir, "demo_before.txt"))
    if not before_path.exists():  # The initial policy's response.
      echo(f"the initial policy writes memory for session {demo_session}"
           " ...")
      write_atomic(before_path, loop.greedy_response(demo_ref))
    loop.run(stop, echo)
  echo("the trained policy writes memory for the same session ...")
  after = loop.greedy_response(demo_ref)
  history = read_metrics(workdir)  # Every step, resumed runs too.
  before = before_path.read_text()
  written = [written_memory(demo, text, loop.encoder, loop.memory)
             for text in (before, after)]
  facts = json.dumps({"steps": loop.loop.step,
                      "resumed_from": loop.resumed_from,
                      "wall_s": round(time.perf_counter() - start, 1)})
  warm_start = loop.policy_config.init_checkpoint
  started_from = (f"the warm start in {warm_start}" if warm_start
                  else "the loaded model")
  return summary_text(history, demo_session, session_line(demo), *written,
                      start=started_from) + "\n" + facts
