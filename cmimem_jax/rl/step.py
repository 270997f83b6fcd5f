"""One GRPO step as a library object, knowing nothing of what is rewarded:
prompts -> G rollouts each (any `GenerationEngine`, through a
`ChatPolicy`) -> the caller's reward -> group advantages -> one update of
the `Learner`, with the engine's housekeeping around it.

The reward is passed in, as Tunix's `reward_fns` and verl's `reward_fn`
are: a callable from the step's `Rollouts` (token ids and texts) to
`Scores` (per-row rewards, the validity gate, per-token loss weights, its
own metrics and whatever per-row details its caller wants back), or an
`IncrementalReward` that takes the rollouts wave by wave as they are
decoded and scores them beside the decoding of the next (the CMI-Mem
task's, `task.loop`: its endpoint calls are in flight while the chips
decode); `tools/bench.py` and `tools/device_check.py` pass a small
callable; the step is the same object. What an engine needs around an
update (freeing its KV buffers, programs or weight copy; the learner
recomputing old log-probs it does not trust; what a weight push reports)
goes through `GenerationEngine` hooks, never a type check.

`lower_rollout` / `lower_update` lower, from the step's own engine and
learner (abstract weights allowed), the two programs a step runs:
`tools/plan.py` compiles them for a TPU topology.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import numpy as np
from absl import logging

from cmimem_jax.rl.advantages import group_advantages
from cmimem_jax.rl.batch import rollout_batch, shared_prompt_group
from cmimem_jax.rl.logprobs import recompute_logprobs
from cmimem_jax.rl.trainer import Learner
from cmimem_jax.sampling.constraint import TokenConstraint
from cmimem_jax.sampling.policy import ChatPolicy
from cmimem_jax.sampling.sampler import SampleOutput, concatenate_outputs


@dataclasses.dataclass(frozen=True)
class RolloutSettings:
  """How a step samples: `group` rollouts per prompt (GRPO's N) at
  `temperature` / `top_p`, at most `max_new_tokens` each;
  `logprob_chunk`: the learner's chunk when it recomputes old log-probs
  (engines whose log-probs are not the learner's);
  `release_programs_each_step`: the engine drops its compiled programs
  before every update (`GenerationEngine.release`);
  `score_beside_decoding`: each decoding wave is given to the reward
  (`IncrementalReward.add`) as soon as it is decoded, while the next
  decodes; False: every wave is decoded before the first is scored (the
  order of a step without waves; the same samples and scores, kept as
  the tests' oracle)."""
  group: int
  temperature: float
  top_p: float
  max_new_tokens: int
  logprob_chunk: int = 256
  release_programs_each_step: bool = False
  score_beside_decoding: bool = True

  def __post_init__(self):
    if self.group < 1 or self.max_new_tokens < 1:
      raise ValueError("group and max_new_tokens must be positive")


@dataclasses.dataclass(frozen=True)
class Rollouts:
  """What a reward scores: B = prompts x `group` rows, row `p·G + i` the
  i-th rollout of prompt p. `completions`: each row's tokens without a
  trailing EOS, `texts` their decoding (`ChatPolicy.decode`)."""
  output: SampleOutput
  completions: list[list[int]]
  texts: list[str]
  group: int


@dataclasses.dataclass
class Scores:
  """A reward's verdict on `Rollouts`.

  rewards: `[B]` (NaN / inf allowed: counted, and the row made invalid).
  valid: `[B]` validity gate (invalid rows count as reward 0 in the
    advantages); None: every row valid.
  token_weights: `[B, R]` loss weights of the completion tokens; None: 1.
  metrics: the reward's own step metrics (logged with the step's).
  details: anything per row the caller wants back (`StepResult.scores`).
  """
  rewards: np.ndarray
  valid: np.ndarray | None = None
  token_weights: np.ndarray | None = None
  metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
  details: Any = None


RewardFn = Callable[[Rollouts], Scores]


@runtime_checkable
class IncrementalReward(Protocol):
  """A reward that scores a step's rollouts as their decoding waves arrive
  (`GRPOStep.__call__`): `add` gets each wave's `Rollouts` (consecutive
  rows, whole groups, in row order; the engine's own log-probs) as soon
  as it is decoded, e.g. to parse and apply its responses and send their
  endpoint calls while the next wave decodes; `finish` gets the whole
  step's `Rollouts` (the log-probs the update uses) and returns every
  row's `Scores`, waiting for whatever `add` started.

  `needs_device`: `add` runs programs on the engine's devices (an
  in-process encoder, the policy writing memory as core compressor or
  MERGE summariser). The step then starts the next wave after `add`
  returns (between waves), with the wave's KV buffers freed, instead of
  before it: a device runs programs in the order they were dispatched,
  so a program `add` dispatched behind a decoding wave would wait for the
  whole wave, and the wave's endpoint calls would wait with it. The
  endpoint calls `add` sent still overlap the next wave; the device idles
  only while `add` runs. (With the policy as an editor, `add` decodes on
  the engine itself, with its weights and a KV buffer of its own shape.)
  False: `add` is host work (parsing, endpoint calls, a host encoder) and
  runs while the next wave decodes.
  """

  needs_device: bool

  def add(self, wave: Rollouts) -> None:
    ...

  def finish(self, rollouts: Rollouts) -> Scores:
    ...


class WholeStepReward:
  """An `IncrementalReward` scoring the whole step at once with a
  `RewardFn` (a plain callable reward): nothing happens per wave; the
  callable runs in `finish`, after the last wave."""

  needs_device = False

  def __init__(self, reward: RewardFn):
    self.reward = reward

  def add(self, wave: Rollouts) -> None:
    del wave

  def finish(self, rollouts: Rollouts) -> Scores:
    return self.reward(rollouts)


@dataclasses.dataclass
class StepResult:
  """One step's metrics, its rollouts, the reward's scores, and the
  rewards / gate / advantages the update used (`[B]`; non-finite rewards
  replaced by 0 and gated)."""
  metrics: dict[str, Any]
  rollouts: Rollouts
  scores: Scores
  rewards: np.ndarray
  valid: np.ndarray
  advantages: np.ndarray


class GRPOStep:
  """Rollouts -> reward -> advantages -> one `Learner` update.

  Args:
    learner: the policy's sharded state and compiled update.
    policy: generates the rollouts (its engine holds the learner's weights,
      `set_model` after every update).
    settings: how rollouts are sampled.
    constraint: the engine's grammar constraint, if rollouts are decoded
      under one (the learner takes its log-probs under the same mask).
  """

  def __init__(self, learner: Learner, policy: ChatPolicy,
               settings: RolloutSettings,
               constraint: TokenConstraint | None = None):
    self.learner, self.policy, self.settings = learner, policy, settings
    self.constraint = constraint

  @property
  def engine(self) -> Any:
    return self.policy.engine

  def __call__(self, prompts: Sequence[Sequence[int]], key: jax.Array,
               reward: RewardFn | IncrementalReward) -> StepResult:
    """One step on `prompts` (token ids, one per group) sampled with `key`.

    With `settings.score_beside_decoding` each decoding wave goes to the
    reward (`IncrementalReward.add`) as it arrives, while the engine
    decodes the next (`GenerationEngine.generate_waves`, the next wave
    dispatched first unless the reward `needs_device`); the waves, keys
    and samples are those of one `generate` call, so tokens, log-probs and
    scores equal the serial order's. The update waits for every score.

    Metrics: the learner's, the engine's (`update_metrics`; the mean
    |engine - learner| log-prob gap where the learner recomputed them),
    the reward's own (`Scores.metrics`), then reward_mean / reward_std /
    reward_group_std (within-group spread, what advantages are made of),
    validity_rate, nonfinite_rewards, response_tokens_mean, decode_waves,
    sample_s (until the last wave is on the host, with the learner's
    recompute of old log-probs), reward_s (the scoring the update waited
    for after that: the last wave's `add` and `finish`) and
    wave_scoring_s (the reward's `add` of the earlier waves, inside
    sample_s: beside decoding, or between waves where it needs the device).
    """
    s = self.settings
    rows = [list(p) for p in prompts for _ in range(s.group)]
    scoring = (reward if isinstance(reward, IncrementalReward)
               else WholeStepReward(reward))
    beside = s.score_beside_decoding
    between = beside and scoring.needs_device
    start = time.perf_counter()
    waves, add_s = [], []
    for out in self.policy.generate_waves(rows, key, s.temperature, s.top_p,
                                          s.max_new_tokens,
                                          ahead=not between):
      arrived = time.perf_counter()
      completions = [self.policy.completion_tokens(out, i)
                     for i in range(len(out.lengths))]
      waves.append(Rollouts(out, completions,
                            [self.policy.decode(c) for c in completions],
                            s.group))
      if beside:
        if between:
          # The reward's programs get the wave's KV buffers' memory (the
          # next wave allocates its own).
          self.engine.release()
        scoring.add(waves[-1])
        add_s.append(time.perf_counter() - arrived)
    # The KV buffers are not needed again this step: scoring (the encoder,
    # the policy's own edits) gets their memory.
    self.engine.release()
    if not beside:
      for wave in waves:
        scoring.add(wave)
    out = (waves[0].output if len(waves) == 1
           else concatenate_outputs([w.output for w in waves]))
    sampler_gap, recompute_s = None, 0.0
    if (not self.engine.reports_learner_logprobs
        and self.learner.config.loss.old_logprobs == "sampler"):
      # The learner's old log-probs are its own, not the engine's (with
      # "learner" the update takes them from its own forward instead, and
      # logs the engine's gap to them). After the last wave's `add`: its
      # endpoint calls are in flight meanwhile.
      begin = time.perf_counter()
      old, sampler_gap = recompute_logprobs(self.learner.model, out,
                                            s.temperature, s.logprob_chunk)
      out = dataclasses.replace(out, logprobs=old)
      recompute_s = time.perf_counter() - begin
    rollouts = Rollouts(out, [c for w in waves for c in w.completions],
                        [t for w in waves for t in w.texts], s.group)
    scores = scoring.finish(rollouts)
    sample_s = arrived - start + recompute_s
    reward_s = time.perf_counter() - arrived - recompute_s
    rewards = np.asarray(scores.rewards, np.float64)
    if rewards.shape != (len(rows),):
      raise ValueError(f"the reward gave {rewards.shape} rewards for "
                       f"{len(rows)} rollouts")
    # A NaN / inf reward makes its rollout invalid: counted and logged,
    # and the run goes on.
    finite = np.isfinite(rewards)
    if not finite.all():
      logging.warning("%d non-finite rewards, scored as invalid rollouts",
                      int((~finite).sum()))
    rewards = np.where(finite, rewards, 0.0)
    valid = finite if scores.valid is None else (
        np.asarray(scores.valid, bool) & finite)
    advantages = group_advantages(rewards, valid, s.group)
    batch = rollout_batch(out, advantages, scores.token_weights,
                          self.constraint)
    # The update needs the memory more than the engine's buffers do.
    self.engine.release(programs=s.release_programs_each_step, weights=True)
    metrics = self.learner.step(batch)
    self.policy.set_model(self.learner.model)
    metrics.update(self.engine.update_metrics())
    if sampler_gap is not None:
      metrics["sampler_trainer_logprob_gap"] = sampler_gap
    metrics.update(scores.metrics)
    metrics.update(
        reward_mean=float(rewards.mean()), reward_std=float(rewards.std()),
        reward_group_std=float(rewards.reshape(-1, s.group).std(1).mean()),
        validity_rate=float(valid.mean()),
        nonfinite_rewards=int((~finite).sum()),
        response_tokens_mean=float(np.mean(out.lengths)),
        decode_waves=len(waves), sample_s=sample_s, reward_s=reward_s,
        wave_scoring_s=float(sum(add_s[:-1])))
    return StepResult(metrics, rollouts, scores, rewards, valid, advantages)

  # -- the programs a step runs, lowered ahead of time -----------------------

  def lower_rollout(self, prompts: int, prompt_length: int
                    ) -> jax.stages.Lowered:
    """The generation program of one decoding wave of `prompts` prompts'
    `group` rollouts each in prompt bucket `prompt_length`, as the
    engine runs it (`GenerationEngine.lower`)."""
    s = self.settings
    group = s.group if getattr(self.engine, "share_prompts", True) else 1
    return self.engine.lower(prompts * s.group, prompt_length,
                             s.max_new_tokens, group=group)

  def update_prompt_group(self, rows: int) -> int:
    """Rows per shared prompt the learner's update of `rows` rollouts
    takes (`Learner`: `shared_prompt_group` of a step's batch, whose
    consecutive `group` rows share their prompt)."""
    config = self.learner.config
    if not config.share_prompts:
      return 1
    prompts = np.repeat(np.arange(rows // self.settings.group),
                        self.settings.group)[:, None].astype(np.int32)
    return shared_prompt_group(prompts, np.ones_like(prompts), 1,
                               config.micro_batches * self.learner.shards)

  def lower_update(self, rows: int, prompt_length: int
                   ) -> jax.stages.Lowered:
    """The learner's update program for a step of `rows` rollouts whose
    prompts are `prompt_length` columns (then `max_new_tokens`), as
    `__call__` runs it: `rollout_batch`'s arrays, the first completion
    column `prompt_length`, the update's prompt group."""
    width = prompt_length + self.settings.max_new_tokens
    batch = {name: jax.ShapeDtypeStruct(
        (rows,) if name == "advantages" else (rows, width), dtype)
             for name, dtype in ROLLOUT_BATCH_DTYPES.items()
             if name in self.learner.config.batch_keys}
    return self.learner.lower(batch, prompt_length,
                              self.update_prompt_group(rows))


# `rollout_batch`'s arrays as the learner receives them.
ROLLOUT_BATCH_DTYPES = {
    "tokens": np.int32, "mask": np.int32, "loss_mask": np.int32,
    "old_logprobs": np.float32, "advantages": np.float32,
    "token_weights": np.float32, "constraint_states": np.int32,
    "constraint_budgets": np.int32}
