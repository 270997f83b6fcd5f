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
import json
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from cmimem_jax import storage
from cmimem_jax.cmi.logprob import PolicyProfileLM
from cmimem_jax.config import (Interrupted, check_failures, finite_number,
                               register_section, validate_config,
                               write_config)
from cmimem_jax.data import Dialogue, WorkdirLock, load_configured
from cmimem_jax.data.files import write_atomic
from cmimem_jax.encoders import Encoder, encoder_identity, make_encoder
from cmimem_jax.memory.builder import EDIT_COUNTERS
from cmimem_jax.memory.compression import memory_editors
from cmimem_jax.memory.dsl import response_regex
from cmimem_jax.memory.prompt_builder import PolicyPrompter
from cmimem_jax.models.attention import ATTENTION_IMPLS
from cmimem_jax.models.host_memory import (release_free_heap,
                                          return_large_blocks)
from cmimem_jax.models.qwen3.params import save_hf
from cmimem_jax.parallel import (initialize_distributed, make_mesh,
                                 parse_mesh_shape, resolve_mesh_shape)
from cmimem_jax.models.qwen3 import Qwen3
from cmimem_jax.rl import (OLD_LOGPROBS, Checkpointer, GRPOLossConfig,
                           GRPOStep, Learner, MetricsWriter, OptimizerConfig,
                           Rollouts, RolloutSettings, Scores,
                           StopSignals, TrainStepConfig, load_model_weights,
                           read_metrics)
from cmimem_jax.rl.checkpoint import metrics_follow_checkpoints
from cmimem_jax.sampling import (ChatPolicy, TokenConstraint,
                                 load_policy_and_tokenizer, special_ids)
from cmimem_jax.sampling.sampler import DECODE_DEVICES
from cmimem_jax.sampling.vllm_engine import (VLLMEngine, checkpoint_dir,
                                             import_vllm)
from cmimem_jax.task.curriculum import (Curriculum, SessionRef,
                                        candidate_fragments, difficulty)
from cmimem_jax.task.episode import (Episode, RolloutScorer,
                                     attribution_weights, score_rollouts,
                                     session_questions)
from cmimem_jax.task.qa_reward import QAReward
from cmimem_jax.task.report import session_line, summary_text, written_memory
from cmimem_jax.task.reward import (NO_EXPERT_RESPONSE, RewardComputer,
                                    RewardConfig)
from cmimem_jax.task.skip_table import calibrated
from cmimem_jax.task.snapshots import (build_snapshots, expert_responses,
                                       load_expert_snapshots, load_snapshots,
                                       save_snapshots)


def _check_training(c) -> None:
  c.check("rollout.engine", lambda v: v in ("jax", "vllm"), "jax or vllm")
  c.check("rollout.constrained_dsl", lambda v: isinstance(v, bool),
          "True or False")
  if c.get("rollout.constrained_dsl") is True and (
      c.get("rollout.engine") == "vllm"):
    c.problems.append("rollout.constrained_dsl needs rollout.engine='jax' "
                      "(the constraint runs inside the JAX decode loop)")
  c.check("rollout.num_rollouts", lambda v: isinstance(v, int) and v >= 2,
          "an int >= 2 (GRPO compares rollouts within a group)")
  c.check("rollout.temperature", lambda v: v >= 0, ">= 0")
  for name in ("release_programs_each_step", "score_beside_decoding"):
    c.check(f"rollout.{name}", lambda v: isinstance(v, bool),
            "True or False")
  c.check("rollout.max_rows_per_wave", lambda v: isinstance(v, int) and v >= 0,
          "a non-negative integer")
  c.check("rollout.decode_devices", lambda v: v in DECODE_DEVICES,
          f"one of {DECODE_DEVICES}: decode on one device, or split the "
          "rows over the mesh's batch axes")
  c.check("rollout.top_p", lambda v: 0 < v <= 1, "in (0, 1]")
  for name in ("max_new_tokens", "max_prompt_tokens"):
    c.check(f"rollout.{name}", lambda v: isinstance(v, int) and v > 0,
            "a positive integer")
  _check_buckets(c)
  c.check("rl.sessions_per_batch", lambda v: isinstance(v, int) and v > 0,
          "a positive integer")
  c.check("rl.learning_rate", lambda v: finite_number(v) and v > 0,
          "a finite number > 0")
  for name in ("weight_decay", "grad_clip_norm", "kl_beta"):
    c.check(f"rl.{name}", lambda v: finite_number(v, 0.0),
            "a finite number >= 0")
  for name in ("epsilon_low", "epsilon_high"):
    c.check(f"rl.{name}", lambda v: finite_number(v, 0.0, 1.0),
            "in [0, 1]")
  for name in ("max_steps", "warmup_steps", "epochs", "validation_sessions",
               "eval_every"):
    c.check(f"rl.{name}", lambda v: isinstance(v, int) and v >= 0,
            "an integer >= 0")
  c.check("rl.curriculum_weights", lambda v: len(v) == 3 and all(
      finite_number(w, 0.0) for w in v), "three finite weights >= 0")
  c.check("rl.micro_batches", lambda v: isinstance(v, int) and v > 0,
          "a positive integer")
  c.check("rl.share_prompts", lambda v: isinstance(v, bool), "True or False")
  c.check("rl.curriculum_tiers", lambda v: isinstance(v, int) and v > 0,
          "a positive integer")
  if c.get("rl.snapshots") != "policy":
    c.check_location("rl.snapshots", "'policy' or a directory of expert "
                     "states (python -m tools.build_expert_states)",
                     directory=True)
  c.check("qa.judge", lambda v: v in ("context_recall", "llm"),
          "context_recall or llm")
  c.check("qa.max_failure_rate", lambda v: finite_number(v, 0.0, 1.0),
          "in [0, 1]")
  c.check("policy.attention_impl", lambda v: v in ATTENTION_IMPLS,
          f"one of {ATTENTION_IMPLS}")
  c.check("policy.source", lambda v: v in ("random", "gguf", "hf"),
          "random, gguf or hf")
  for key in ("memory.compressor", "memory.merge_summarizer"):
    if c.get(key) == "answer" and c.get("qa.judge") != "llm":
      c.problems.append(f"{key}='answer' needs qa.judge='llm' (the answer "
                        "model is its endpoint)")
  for name in ("clip_ratio_c", "log_ratio_clamp", "kl_clamp"):
    c.check(f"rl.{name}", lambda v: finite_number(v, 0.0),
            "a finite number >= 0 (0: off)")
  # The train step makes one optimizer update per step, so the learner's
  # start-of-step log-probs are π_old ("learner", verl's on-policy path);
  # a loop of several updates on one batch must take "sampler".
  c.check("rl.old_logprobs", lambda v: v in OLD_LOGPROBS,
          f"one of {OLD_LOGPROBS} ('learner': the policy's own, ratio 1; "
          "'sampler': the decode-time ones)")
  try:
    grpo_loss_config(c.get("rl"))
  except (TypeError, ValueError, AttributeError) as e:
    c.problems.append(f"rl: {e}")
  rollouts, sessions = c.get("rollout.num_rollouts"), c.get(
      "rl.sessions_per_batch")
  micro, tiers = c.get("rl.micro_batches"), c.get("rl.curriculum_tiers")
  if all(isinstance(v, int) and v > 0
         for v in (rollouts, sessions, micro, tiers)):
    rows = rollouts * sessions
    if sessions < tiers:
      c.problems.append(f"rl.sessions_per_batch={sessions} must be >= "
                        f"rl.curriculum_tiers={tiers} (every batch draws "
                        "from every tier)")
    try:
      mesh = resolve_mesh_shape(parse_mesh_shape(c.get("mesh")),
                                len(jax.devices()))
      shards = mesh["data"] * mesh["fsdp"]
      if rows % (micro * shards):
        c.problems.append(
            f"rollout rows {sessions} sessions x {rollouts} rollouts = {rows}"
            f" must divide into rl.micro_batches={micro} x {shards} data "
            f"shards of mesh {c.get('mesh')!r}")
      wave = c.get("rollout.max_rows_per_wave")
      if (c.get("rollout.decode_devices") == "mesh"
          and c.get("rollout.engine") == "jax" and isinstance(wave, int)
          and wave % (rollouts * shards)):
        c.problems.append(
            f"rollout.max_rows_per_wave={wave} must be whole groups of "
            f"{rollouts} rollouts x {shards} batch shards of mesh "
            f"{c.get('mesh')!r} (rollout.decode_devices='mesh': every "
            "chip decodes its share of every wave)")
    except (ValueError, AttributeError) as e:
      c.problems.append(f"mesh: {e}")


register_section("rl", _check_training)

def grpo_loss_config(rl: Any) -> GRPOLossConfig:
  """The GRPO objective of an `rl` config section (raises ValueError on a
  bad value, AttributeError on a missing key)."""
  return GRPOLossConfig(
      rl.epsilon_low, rl.epsilon_high, rl.kl_beta, rl.loss_aggregation,
      clip_ratio_c=rl.clip_ratio_c, log_ratio_clamp=rl.log_ratio_clamp,
      kl_clamp=rl.kl_clamp, old_logprobs=rl.old_logprobs)


def train_step_config(config: Any, constraint: TokenConstraint | None
                      ) -> TrainStepConfig:
  """The learner's step of a training config: the `rl` section's
  objective (`grpo_loss_config`), optimizer and micro-batching, the
  rollouts' temperature, and the constraint's EOS when rollouts are
  grammar-constrained."""
  rl = config.rl
  return TrainStepConfig(
      loss=grpo_loss_config(rl),
      optimizer=OptimizerConfig(
          learning_rate=rl.learning_rate, warmup_steps=rl.warmup_steps,
          weight_decay=rl.weight_decay, grad_clip_norm=rl.grad_clip_norm),
      micro_batches=rl.micro_batches,
      temperature=config.rollout.temperature,
      logprob_chunk=rl.logprob_chunk, share_prompts=rl.share_prompts,
      constraint_eos_id=None if constraint is None else constraint.eos_id)


def rollout_settings(config: Any) -> RolloutSettings:
  """How a training config's GRPO step samples (`rl.step.GRPOStep`)."""
  rollout = config.rollout
  return RolloutSettings(
      group=rollout.num_rollouts, temperature=rollout.temperature,
      top_p=rollout.top_p, max_new_tokens=rollout.max_new_tokens,
      logprob_chunk=config.rl.logprob_chunk,
      release_programs_each_step=rollout.release_programs_each_step,
      score_beside_decoding=rollout.score_beside_decoding)


def jax_policy(config: Any, model: Qwen3, tokenizer: Any, mesh: Mesh,
               constraint: TokenConstraint | None) -> ChatPolicy:
  """The rollout policy of a training config on the JAX engine: the
  `Sampler` over `model` (the learner's weights; abstract ones for
  `tools/plan.py`), decoding on `rollout.decode_devices` of `mesh` in
  waves of `rollout.max_rows_per_wave`."""
  rollout = config.rollout
  return ChatPolicy.jax(model, tokenizer, rollout.max_prompt_tokens,
                        tuple(rollout.buckets), mesh, constraint=constraint,
                        max_rows_per_wave=rollout.max_rows_per_wave,
                        decode_devices=rollout.decode_devices)


def grpo_step(config: Any, model: Qwen3, tokenizer: Any, mesh: Mesh,
              workdir: str = "") -> GRPOStep:
  """The GRPO step of a training config as `Trainer` runs it: the
  learner of `model` (`train_step_config`, the KL / App. E reference),
  the rollout engine (`jax_policy`, or vLLM over an HF copy of the
  weights in `workdir`), the grammar constraint when
  `rollout.constrained_dsl`. `model` may be abstract (`abstract_model`):
  then nothing is placed and the step only lowers its programs
  (`tools/plan.py`)."""
  # Grammar-constrained rollouts: every response is valid DSL, and the
  # learner takes its log-probs under the same mask.
  constraint = (TokenConstraint.from_regex(response_regex(), tokenizer)
                if config.rollout.constrained_dsl else None)
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
  learner = Learner(model, train_step_config(config, constraint), mesh,
                    min_budget=min_budget,
                    keep_reference=config.reward.estimator == "logprob")
  if config.rollout.engine == "vllm":
    directory = checkpoint_dir(workdir)
    save_hf(learner.model, directory)
    eos_ids, pad_id = special_ids(tokenizer)
    policy = ChatPolicy(
        VLLMEngine(directory, eos_ids, pad_id, tuple(config.rollout.buckets),
                   **dict(config.rollout.get("vllm", {}))),
        tokenizer, config.rollout.max_prompt_tokens)
  else:
    policy = jax_policy(config, learner.model, tokenizer, mesh, constraint)
  return GRPOStep(learner, policy, rollout_settings(config), constraint)


def rollout_prompter(config: Any, encoder: Encoder, policy: ChatPolicy
                     ) -> PolicyPrompter:
  """The policy's prompt in training (rollouts, validation, policy-built
  snapshots, the demo's responses): `rollout.retrieval_top_k` entries per
  type, trimmed to the policy's prompt budget (`rollout.max_prompt_tokens`)
  as evaluation's `policy` builder trims to its model's."""
  return PolicyPrompter(encoder, config.rollout.retrieval_top_k,
                        policy.prompt_fits)


def _is_abstract(model: Qwen3) -> bool:
  return any(isinstance(x, jax.ShapeDtypeStruct)
             for x in jax.tree.leaves(nnx.state(model)))


def _check_buckets(c) -> None:
  """Prompts are left-padded to `rollout.buckets` (ascending; the largest
  must hold `rollout.max_prompt_tokens`, or a valid prompt is refused
  mid-run). vLLM may take none: its rows then reach the learner padded to
  the batch's longest prompt (a train step compiled per length)."""
  buckets, longest = c.get("rollout.buckets"), c.get(
      "rollout.max_prompt_tokens")
  if not isinstance(buckets, (tuple, list)) or not all(
      isinstance(b, int) and b > 0 for b in buckets) or list(
          buckets) != sorted(set(buckets)):
    c.problems.append(f"rollout.buckets={buckets!r}: must be ascending "
                      "positive token counts")
  elif not buckets:
    if c.get("rollout.engine") != "vllm":
      c.problems.append("rollout.buckets=(): the JAX engine needs buckets "
                        "(one compiled sampler per bucket)")
  elif isinstance(longest, int) and buckets[-1] < longest:
    c.problems.append(f"rollout.buckets={tuple(buckets)}: the largest must "
                      f"hold rollout.max_prompt_tokens={longest}")


def training_dialogues(dataset: Any) -> list[Dialogue]:
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


def plan_sessions(config: Any, dialogues: list[Dialogue]
                  ) -> tuple[list[SessionRef], Curriculum]:
  """(the held-out validation sessions, the curriculum of the others): what
  a training config trains on, from its `rl` section and `seed` alone (no
  model), as `Trainer` plans it."""
  rl = config.rl
  sessions = _training_sessions(dialogues, tuple(rl.curriculum_weights))
  # Held-out sessions, fixed by the seed, never in a training batch: the
  # validation curve (`rl.eval_every`).
  validation, sessions = split_validation(sessions, rl.validation_sessions,
                                          config.seed)
  return validation, Curriculum(sessions, rl.sessions_per_batch,
                                rl.curriculum_tiers, max(1, rl.epochs))


def _mean_terms(terms) -> dict[str, float]:
  sums: dict[str, list[float]] = collections.defaultdict(list)
  for t in terms:
    for name, value in t.scalars().items():
      sums[name].append(value)
  return {f"reward/{k}": float(np.mean(v)) for k, v in sums.items()}


def scoring_needs_device(encoder: Encoder, memory: Any) -> bool:
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
    self.scorer = RolloutScorer(trainer.encoder, trainer.config.memory,
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
    trainer._check_qa_failures(trainer.loop["step"] + 1, self.episodes,
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

  def __init__(self, config, workdir: str):
    validate_config(config, required=("dataset", "encoder", "memory",
                                      "reward", "policy", "rollout", "rl",
                                      "qa"))
    if config.rollout.engine == "vllm":
      import_vllm()  # Fails fast, with the install hint, where it is absent.
    # The Semantic SKIP thresholds of this encoder (refused before anything
    # loads when it has none: tools/skip_calibration.py first).
    reward_config = calibrated(RewardConfig.from_config(config.reward),
                               config.encoder)
    # Freed step / decode buffers leave the resident set at once (a JAX
    # CPU device's memory is this process's heap).
    return_large_blocks()
    initialize_distributed()
    self.config, self.workdir = config, workdir
    # What can refuse the inputs (the mesh, the dataset, the held-out
    # split) runs before the workdir exists: a refused run leaves none.
    self.mesh = make_mesh(config.mesh)
    self.dialogues = training_dialogues(config.dataset)
    self.validation, self.curriculum = plan_sessions(config, self.dialogues)
    # One writer per workdir (process 0 writes for a multi-host job).
    self.lock = WorkdirLock(workdir, "train")
    if jax.process_index() == 0:
      self.lock.acquire()
    storage.makedirs(workdir)
    if jax.process_index() == 0:
      write_config(config, workdir)
    self.encoder = make_encoder(config.encoder)
    model, tokenizer = load_policy_and_tokenizer(config.policy)
    if config.policy.init_checkpoint:  # The KL reference starts here too.
      load_model_weights(model, config.policy.init_checkpoint)
    needed = config.rollout.max_prompt_tokens + config.rollout.max_new_tokens
    if needed > model.config.max_position_embeddings:
      raise ValueError(
          f"rollout.max_prompt_tokens + max_new_tokens = {needed} exceeds the "
          f"policy's max_position_embeddings "
          f"{model.config.max_position_embeddings}")
    self.group = config.rollout.num_rollouts
    self.grpo = grpo_step(config, model, tokenizer, self.mesh, workdir)
    self.learner, self.policy = self.grpo.learner, self.grpo.policy
    self.prompter = rollout_prompter(config, self.encoder, self.policy)
    self.constraint = self.grpo.constraint
    self.total_steps = config.rl.max_steps or self.curriculum.planned_steps
    self.checkpointer = Checkpointer.for_workdir(workdir, config.checkpoint)
    self.key = jax.random.key(config.seed)
    self.loop = {"step": 0, "snapshot_version": 0, "snapshot_epoch": 0}
    # The last step's rollouts, one record each (with `rl.log_rollouts`).
    self.rollout_records: list[dict[str, Any]] = []
    restored = self.checkpointer.restore(self.learner.params,
                                         self.learner.opt_state, self.key)
    if restored is not None:
      self.learner.params = restored.params
      self.learner.opt_state = restored.opt_state
      self.key, self.loop = restored.rng, restored.loop_state
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
                         config.rollout.max_prompt_tokens,
                         tuple(config.rollout.buckets), self.mesh,
                         decode_devices=config.rollout.decode_devices),
          lambda: reference, reward_config.profile_max_new_tokens,
          config.rl.logprob_chunk)
    self.reward = RewardComputer(self.encoder, reward_config, profile_lm)
    self.qa = QAReward.from_config(config, self.encoder)
    self.editors = memory_editors(
        config.memory, {"policy": self.policy, "answer": self.qa.answerer})
    self.scoring_needs_device = scoring_needs_device(self.encoder,
                                                     config.memory)
    self.fixed_snapshots = config.rl.snapshots != "policy"
    if self.fixed_snapshots:
      self.snapshots = load_expert_snapshots(
          config.rl.snapshots, self.dialogues, encoder_identity(config.encoder))
    else:
      self.snapshots = self._snapshots(self.loop["snapshot_version"])
    # The teacher's responses (fixed expert states only): the length
    # penalty's reference (`reward.length_reference`).
    self.expert = (expert_responses(config.rl.snapshots)
                   if self.fixed_snapshots else {})

  # -- snapshots -------------------------------------------------------------

  def _respond(self, conversations):
    return self.policy.respond(conversations,
                               self.config.rollout.max_new_tokens)

  def _snapshots(self, version: int):
    directory = storage.join(self.workdir, "snapshots", f"v{version}")
    banks = load_snapshots(directory, self.dialogues)
    if banks is None:
      start = time.perf_counter()
      banks = build_snapshots(self.dialogues, self._respond, self.prompter,
                              self.encoder, self.config.memory, self.editors)
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
                              self.config.memory, self.qa, self.reward,
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
    step = self.loop["step"]
    epoch = self.curriculum.epoch(step)
    refresh = self.config.rl.snapshot_refresh_epochs
    if not self.fixed_snapshots and refresh and epoch > 0 and (
        epoch % refresh == 0) and self.loop["snapshot_epoch"] != epoch:
      self.loop["snapshot_version"] += 1
      self.loop["snapshot_epoch"] = epoch
      self.snapshots = self._snapshots(self.loop["snapshot_version"])
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
        epoch=epoch, snapshot_version=self.loop["snapshot_version"],
        sessions=[f"{self.dialogues[r.dialogue].dialogue_id}/{r.session}"
                  for r in refs])
    terms, texts = result.scores.details, result.rollouts.texts
    self.rollout_records = [] if not self.config.rl.log_rollouts else [
        {"session": metrics["sessions"][i // self.group],
         "session_id": episodes[i // self.group].session.session_id,
         "rollout": i % self.group, "advantage": float(result.advantages[i]),
         **t.scalars(),
         "semantic_skip_statement_cosines": (
             t.semantic_skip_statement_cosines),
         "response": text}
        for i, (t, text) in enumerate(zip(terms, texts))]
    self.loop["step"] = step + 1
    return metrics

  def _check_qa_failures(self, step: int, episodes: list[Episode],
                         terms: list[Any], failures_before: int) -> None:
    """Raises `config.CallsFailed` (before the step's update: the newest
    checkpoint stays the run's state) when more of this step's QA
    questions went unjudged (failed calls) than `qa.max_failure_rate`
    accepts. Only valid rollouts' banks are asked their questions."""
    failed = sum(self.qa.failures.values()) - failures_before
    if failed:
      qa = self.config.qa
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
    step = self.loop["step"]
    if step not in self.checkpointer.steps():
      self.checkpointer.save(step, self.learner.params,
                             self.learner.opt_state, self.key,
                             dict(self.loop))

  def run(self, stop: StopSignals | None = None,
          echo: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Trains to `total_steps`, checkpointing; returns this run's metrics.
    `echo` (e.g. `print`) receives a line as the first step begins and
    one per step, instead of the progress bar.

    SIGTERM / SIGINT (`stop`, or signals watched here) end the run at the
    next step boundary with a checkpoint and `config.Interrupted`.
    """
    writer = MetricsWriter(self.workdir, self.total_steps,
                           tensorboard=self.config.tensorboard,
                           start_step=self.loop["step"],
                           progress=False if echo else None,
                           rollouts=self.config.rl.log_rollouts)
    every = self.config.checkpoint.every_steps
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
        echo(f"training: steps {self.loop['step'] + 1}..{self.total_steps}"
             + resumed if self.loop["step"] < self.total_steps else
             f"training: steps done, all {self.total_steps}{resumed}")
      while self.loop["step"] < self.total_steps:
        if stop.requested(self.loop["step"], self.checkpointer.manager):
          self.save_checkpoint()
          self.checkpointer.wait()
          raise Interrupted(stop.message(self.loop["step"]), stop.signum)
        metrics = self.step()
        step = self.loop["step"]
        eval_every = self.config.rl.eval_every
        if self.validation and eval_every and (step % eval_every == 0
                                               or step == self.total_steps):
          metrics.update(self.validate())
        writer.write(step, metrics)
        if self.config.rl.log_rollouts:
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


def train(config, workdir: str,
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
  written = [written_memory(demo, text, loop.encoder, config.memory)
             for text in (before, after)]
  facts = json.dumps({"steps": loop.loop["step"],
                      "resumed_from": loop.resumed_from,
                      "wall_s": round(time.perf_counter() - start, 1)})
  started_from = (f"the warm start in {config.policy.init_checkpoint}"
                  if config.policy.init_checkpoint else "the loaded model")
  return summary_text(history, demo_session, session_line(demo), *written,
                      start=started_from) + "\n" + facts
