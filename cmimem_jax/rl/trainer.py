"""The learner: a sharded, jitted train step for any Flax causal LM, with
the objective as configuration (`GRPOLossConfig` for RL rollouts,
`SFTLossConfig` for the supervised warm start), as Tunix's RL and SFT
trainers share one base.

State is functional: `params` (a pure dict of arrays, split from the NNX
model) and the optax state, both placed on the mesh by the partition rules
and donated to the step. One step = k micro-batches scanned with gradient
accumulation (the token-mean denominator is the global batch's, so the sum
is the full-batch gradient) -> global-norm clipping -> AdamW.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from cmimem_jax.models.host_memory import release_free_heap
from cmimem_jax.models.qwen3.model import Qwen3
from cmimem_jax.parallel.mesh import BATCH_AXES, batch_divisor
from cmimem_jax.parallel.partition import (QWEN3_RULES, Rules,
                                           optimizer_shardings,
                                           param_shardings, place_batch)
from cmimem_jax.rl.batch import shared_prompt_group
from cmimem_jax.rl.logprobs import token_logprobs
from cmimem_jax.rl.losses import (GRPOLossConfig, Objective,
                                  aggregation_scale, combine_stats)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  learning_rate: float = 1e-6
  warmup_steps: int = 0
  decay_steps: int = 0        # 0: constant after warm-up; else cosine to 0.
  weight_decay: float = 0.0
  b1: float = 0.9
  b2: float = 0.999
  grad_clip_norm: float = 1.0  # 0 disables clipping.

  def schedule(self) -> optax.Schedule:
    if self.decay_steps:
      return optax.warmup_cosine_decay_schedule(
          0.0, self.learning_rate, max(self.warmup_steps, 1),
          self.warmup_steps + self.decay_steps)
    if self.warmup_steps:
      return optax.linear_schedule(0.0, self.learning_rate, self.warmup_steps)
    return optax.constant_schedule(self.learning_rate)


def make_optimizer(config: OptimizerConfig) -> optax.GradientTransformation:
  adamw = optax.adamw(config.schedule(), b1=config.b1, b2=config.b2,
                      weight_decay=config.weight_decay)
  if config.grad_clip_norm > 0:
    return optax.chain(optax.clip_by_global_norm(config.grad_clip_norm), adamw)
  return adamw


@dataclasses.dataclass(frozen=True)
class TrainStepConfig:
  loss: Objective = GRPOLossConfig()
  optimizer: OptimizerConfig = OptimizerConfig()
  micro_batches: int = 1
  temperature: float = 1.0   # The sampler's; log-probs are scaled alike.
  logprob_chunk: int = 256
  # Set when rollouts are grammar-constrained (`sampling.TokenConstraint`
  # with this EOS id): log-probs are then taken under the sampler's mask,
  # from the batch's `constraint_states` / `constraint_budgets`.
  constraint_eos_id: int | None = None
  # Run each prompt through the model once for the rollouts that continue
  # it (`Qwen3.shared_prompt_hidden_states`) when a batch's consecutive
  # rows share their prompt columns (`shared_prompt_group`). Exact; less
  # work the longer the prompts. Its attention over the prompt is XLA's
  # (a `[T, Tp]` score block per row and head), not splash / cuDNN.
  share_prompts: bool = True

  @property
  def batch_keys(self) -> tuple[str, ...]:
    """The host arrays one step reads."""
    extra = (() if self.constraint_eos_id is None else
             ("constraint_states", "constraint_budgets"))
    return self.loss.batch_keys + extra


def _micro(x: jax.Array, k: int, mesh: Mesh, group: int = 1) -> jax.Array:
  """`[B, ...]` -> `[k, B/k, ...]`, micro-batch i = groups of `group`
  consecutive rows i, i+k, …: a group stays whole, and every device keeps
  its own rows in every micro-batch (no resharding)."""
  rest = x.shape[1:]
  x = x.reshape(x.shape[0] // (k * group), k, group, *rest).swapaxes(0, 1)
  x = x.reshape(k, -1, *rest)
  spec = P(None, BATCH_AXES, *([None] * (x.ndim - 2)))
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def accumulated_grads(graphdef: nnx.GraphDef, config: TrainStepConfig,
                      mesh: Mesh, params: Any, batch: dict[str, jax.Array],
                      ref_params: Any | None, start: int = 1,
                      min_budget: jax.Array | None = None, group: int = 1,
                      trainable: Callable[[str], bool] | None = None
                      ) -> tuple[Any, dict[str, jax.Array]]:
  """Gradient of the global-batch loss (`config.loss`), summed over
  `config.micro_batches` scanned micro-batches, and the loss statistics.
  `start`: first column any row's `loss_mask` covers (static).
  `min_budget`: the constraint's `[S, V]` table when
  `config.constraint_eos_id` is set. `group` (static): rows per shared
  prompt (`shared_prompt_group`; 1: none shared). `trainable` (static):
  None for every parameter, else the parameter paths (`layers/q_proj`)
  that get a gradient; the others' is zero and their weight gradients are
  never computed (the backward of an adapter-only update such as LoRA).

  Every micro-batch is differentiated at the same `params` (the update
  comes after the scan), so on-policy old log-probs (`GRPOLossConfig.
  old_logprobs="learner"`, the stopped log-probs of each micro-batch's own
  forward) are the start-of-step policy's on every micro-batch."""
  k = config.micro_batches
  num_tokens = jnp.sum(batch["loss_mask"].astype(jnp.float32))
  # Each token's share of the global batch's mean, fixed before the split
  # so the micro-batch sums add up to the full-batch loss.
  batch = dict(batch, token_scale=aggregation_scale(batch["loss_mask"],
                                                    config.loss.aggregation))
  micro = {name: _micro(x, k, mesh, group) for name, x in batch.items()}

  def logprobs_of(p, mb):
    constraint = None
    if config.constraint_eos_id is not None:
      constraint = (min_budget, mb["constraint_states"],
                    mb["constraint_budgets"], config.constraint_eos_id)
    return token_logprobs(nnx.merge(graphdef, p), mb["tokens"], mb["mask"],
                          temperature=config.temperature,
                          chunk=config.logprob_chunk, start=start, mesh=mesh,
                          constraint=constraint, group=group)

  def loss_fn(p, mb):
    if trainable is not None:
      p = jax.tree_util.tree_map_with_path(
          lambda path, x: x if trainable(jax.tree_util.keystr(
              path, simple=True, separator="/")) else jax.lax.stop_gradient(x),
          p)
    logprobs, entropy = logprobs_of(p, mb)
    ref = None
    if ref_params is not None:
      ref = jax.lax.stop_gradient(logprobs_of(ref_params, mb)[0])
    return config.loss(logprobs, entropy, mb, ref)

  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def accumulate(carry, mb):
    grads, stats = carry
    (_, step_stats), step_grads = grad_fn(params, mb)
    return (jax.tree.map(jnp.add, grads, step_grads),
            combine_stats(stats, step_stats)), None

  zero_grads = jax.tree.map(jnp.zeros_like, params)
  first = jax.tree.map(lambda x: x[0], micro)
  zero_stats = jax.tree.map(jnp.zeros_like,
                            jax.eval_shape(loss_fn, params, first)[1])
  (grads, stats), _ = jax.lax.scan(accumulate, (zero_grads, zero_stats), micro)
  return grads, dict(stats, num_tokens=num_tokens)


def _train_step(graphdef: nnx.GraphDef, config: TrainStepConfig, mesh: Mesh,
                optimizer: optax.GradientTransformation, start: int,
                group: int, params: Any, opt_state: Any,
                batch: dict[str, jax.Array], ref_params: Any | None,
                min_budget: jax.Array | None):
  grads, stats = accumulated_grads(graphdef, config, mesh, params, batch,
                                   ref_params, start, min_budget, group)
  grad_norm = optax.tree.norm(grads)

  def update(grads, opt_state, params):
    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), new_opt_state, updates

  # A NaN / inf loss, gradient or updated parameter leaves params and
  # optimizer state as they were (the step is counted as skipped), so a
  # checkpoint never holds one. The update is first only inspected (its
  # finiteness and norm, reductions XLA fuses with the arithmetic) on
  # inputs it cannot merge with the real update below
  # (`optimization_barrier`), then applied under `cond`, each leaf in
  # place in its donated buffer. Selecting between whole new and old
  # states instead would keep a second params + optimizer state alive
  # through the step.
  probe_params, _, probe_updates = update(*jax.lax.optimization_barrier(
      (grads, opt_state, params)))
  finite = jnp.isfinite(stats["loss"]) & jnp.isfinite(grad_norm) & jnp.all(
      jnp.stack([jnp.all(jnp.isfinite(x))
                 for x in jax.tree.leaves(probe_params)]))
  params, opt_state = jax.lax.cond(
      finite, lambda: update(grads, opt_state, params)[:2],
      lambda: (params, opt_state))
  stats = dict(stats, grad_norm=grad_norm,
               update_norm=optax.tree.norm(probe_updates),
               update_skipped=(~finite).astype(jnp.float32))
  return params, opt_state, stats


def jit_train_step(graphdef: nnx.GraphDef, config: TrainStepConfig,
                   mesh: Mesh, optimizer: optax.GradientTransformation,
                   param_shardings: Any, opt_shardings: Any,
                   with_reference: bool):
  """The train step under `jax.jit` with explicit shardings and donated
  params / optimizer state:
  `(start, group, params, opt_state, batch, ref_params, min_budget) ->
  (params, opt_state, stats)`, `start` (the first completion column) and
  `group` (rows per shared prompt, `shared_prompt_group`) static."""
  replicated = NamedSharding(mesh, P())
  return jax.jit(
      functools.partial(_train_step, graphdef, config, mesh, optimizer),
      in_shardings=(param_shardings, opt_shardings, None,
                    param_shardings if with_reference else None, replicated),
      out_shardings=(param_shardings, opt_shardings, replicated),
      static_argnums=(0, 1), donate_argnums=(2, 3))


# XLA:CPU's default scheduler orders a program for concurrency; its
# memory-optimised one packs the train step's temporaries tighter at a
# little speed (BENCHMARKS.md "Train step memory", round six). Host memory
# is what runs out on CPU. Set per program, not process-wide (the sampler
# and the CMI kernel keep the default).
_CPU_STEP_COMPILER_OPTIONS = {
    "xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}


def step_compiler_options(mesh: Mesh) -> dict[str, str]:
  """XLA options the train step is compiled with on `mesh`'s platform
  (`Lowered.compile(...)`): none on TPU / GPU."""
  if mesh.devices.flat[0].platform == "cpu":
    return dict(_CPU_STEP_COMPILER_OPTIONS)
  return {}


@dataclasses.dataclass(frozen=True)
class _StepPrograms:
  """What a learner compiles, shared by every learner of the same model
  shape, objective, mesh and rules in a process (a resumed run, an SFT
  learner then a GRPO one): each program is traced and compiled once."""
  optimizer: optax.GradientTransformation
  param_shardings: Any
  opt_shardings: Any
  init_opt_state: Any   # jitted `optimizer.init`, sharded output.
  step: Any             # `jit_train_step`'s function.
  # `step` compiled for each (start, group, batch and table shapes) seen.
  compiled: dict[Any, jax.stages.Compiled] = dataclasses.field(
      default_factory=dict)


@functools.lru_cache(maxsize=4)
def _step_programs(graphdef: nnx.GraphDef, config: TrainStepConfig,
                   mesh: Mesh, rules: tuple[tuple[str, P], ...],
                   abstract_treedef: Any,
                   abstract_leaves: tuple[jax.ShapeDtypeStruct, ...]
                   ) -> _StepPrograms:
  abstract = jax.tree.unflatten(abstract_treedef, abstract_leaves)
  shardings = param_shardings(abstract, mesh, rules)
  optimizer = make_optimizer(config.optimizer)
  opt_shardings = optimizer_shardings(optimizer, abstract, shardings, mesh)
  return _StepPrograms(
      optimizer, shardings, opt_shardings,
      jax.jit(optimizer.init, out_shardings=opt_shardings),
      jit_train_step(graphdef, config, mesh, optimizer, shardings,
                     opt_shardings,
                     with_reference=config.loss.uses_reference))


class Learner:
  """Holds the sharded policy/optimizer state and the compiled step.

  Args:
    model: the policy (its current weights are the starting point).
    config: objective (GRPO or SFT), optimizer, micro-batching,
      temperature.
    mesh: where everything lives (`parallel.make_mesh`).
    rules: partition rules for the model's parameters.
    reference: the frozen reference p_ref (default: a copy of `model`'s
      initial weights): the KL term's, and App. E's scorer; not kept when
      the objective needs none (`kl_beta == 0`, SFT) unless
      `keep_reference`.
    min_budget: the sampler constraint's table (`TokenConstraint`, widened
      to the model's vocabulary) when `config.constraint_eos_id` is set.
  """

  def __init__(self, model: Qwen3, config: TrainStepConfig, mesh: Mesh,
               rules: Rules = QWEN3_RULES, reference: Qwen3 | None = None,
               min_budget: np.ndarray | None = None,
               keep_reference: bool = False):
    self.config, self.mesh = config, mesh
    self.graphdef, state = nnx.split(model, nnx.Param)
    leaves, treedef = jax.tree.flatten(
        jax.eval_shape(lambda: nnx.to_pure_dict(state)))
    programs = _step_programs(self.graphdef, config, mesh,
                              tuple((pattern, spec) for pattern, spec in rules),
                              treedef, tuple(leaves))
    self.optimizer = programs.optimizer
    self.param_shardings = programs.param_shardings
    self.opt_shardings = programs.opt_shardings
    if (min_budget is None) != (config.constraint_eos_id is None):
      raise ValueError("a constrained learner needs both "
                       "config.constraint_eos_id and min_budget")
    replicated = NamedSharding(mesh, P())
    # Abstract weights (`ShapeDtypeStruct` leaves, e.g. `abstract_model`):
    # a learner that only lowers its program (`lower`), for devices this
    # process may not have (`tools/plan.py`'s TPU topologies).
    self.abstract = any(isinstance(x, jax.ShapeDtypeStruct)
                        for x in jax.tree.leaves(state))
    keep = config.loss.uses_reference or keep_reference
    if self.abstract:
      describe = lambda tree, shardings: jax.tree.map(  # noqa: E731
          lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
          tree, shardings)
      self.params = describe(nnx.to_pure_dict(state), self.param_shardings)
      self.opt_state = describe(jax.eval_shape(self.optimizer.init,
                                               self.params),
                                self.opt_shardings)
      self.ref_params = self.params if keep else None
      self.min_budget = None if min_budget is None else jax.ShapeDtypeStruct(
          min_budget.shape, min_budget.dtype, sharding=replicated)
    else:
      self.params = jax.device_put(nnx.to_pure_dict(state),
                                   self.param_shardings)
      self.opt_state = programs.init_opt_state(self.params)
      self.ref_params = None
      if keep:
        source = self.params if reference is None else nnx.to_pure_dict(
            nnx.state(reference, nnx.Param))
        # A real copy: the policy's buffers are donated every step.
        self.ref_params = jax.tree.map(jnp.copy, jax.device_put(
            source, self.param_shardings))
      self.min_budget = None if min_budget is None else jax.device_put(
          min_budget, replicated)
    self.skipped_updates = 0  # Non-finite steps not applied (this run).
    self._programs = programs

  @property
  def shards(self) -> int:
    """Ways the batch is split (`parallel.batch_divisor`)."""
    return batch_divisor(self.mesh)

  @property
  def model(self) -> Qwen3:
    """The current policy as an NNX module (shares the sharded arrays)."""
    return nnx.merge(self.graphdef, self.params)

  @property
  def reference_model(self) -> Qwen3:
    """The frozen reference p_ref as an NNX module (never updated)."""
    if self.ref_params is None:
      raise ValueError("this learner keeps no reference (kl_beta == 0 and "
                       "keep_reference=False)")
    return nnx.merge(self.graphdef, self.ref_params)

  def check_batch(self, batch: dict[str, np.ndarray]) -> None:
    missing = [k for k in self.config.batch_keys if k not in batch]
    if missing:
      raise ValueError(f"batch lacks {missing}")
    rows = batch["tokens"].shape[0]
    step = self.config.micro_batches * batch_divisor(self.mesh)
    if rows % step:
      raise ValueError(
          f"batch of {rows} rows must divide into {self.config.micro_batches}"
          f" micro-batches x {batch_divisor(self.mesh)} data shards")

  def _step_args(self, batch: dict[str, np.ndarray]) -> tuple[Any, ...]:
    """The compiled step's arguments for a host batch."""
    self.check_batch(batch)
    placed = place_batch({k: batch[k] for k in self.config.batch_keys},
                         self.mesh)
    # The LM head runs from the first completion column on (one compiled
    # step per prompt bucket).
    covered = np.flatnonzero(np.asarray(batch["loss_mask"]).any(axis=0))
    first_column = max(int(covered[0]) if covered.size else 1, 1)
    group = 1
    if self.config.share_prompts:
      group = shared_prompt_group(
          np.asarray(batch["tokens"]), np.asarray(batch["mask"]),
          first_column,
          self.config.micro_batches * batch_divisor(self.mesh))
    return (first_column, group, self.params, self.opt_state, placed,
            self.ref_params if self.config.loss.uses_reference else None,
            self.min_budget)

  def compiled(self, batch: dict[str, np.ndarray]) -> jax.stages.Compiled:
    """The step compiled for `batch`'s shapes (its `memory_analysis()`:
    the temporaries one update needs beyond the resident state)."""
    return self._compiled_step(self._step_args(batch))

  def lower(self, batch: dict[str, jax.ShapeDtypeStruct], start: int,
            group: int) -> jax.stages.Lowered:
    """The update program for a batch of these shapes (split over the
    batch axes as `place_batch` places it), first completion column
    `start` and `group` rows per shared prompt, lowered: what `step` runs
    for such a batch (`tools/plan.py` compiles it from abstract weights)."""
    placed = {name: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=(
        NamedSharding(self.mesh, P(BATCH_AXES, *([None] * (len(x.shape)
                                                           - 1))))))
              for name, x in batch.items()}
    return self._lower((start, group, self.params, self.opt_state, placed,
                        self.ref_params if self.config.loss.uses_reference
                        else None, self.min_budget))

  def _lower(self, args: tuple[Any, ...]) -> jax.stages.Lowered:
    # The mesh in context: the splash attention kernel shards itself over
    # it (`models.attention`).
    with jax.set_mesh(self.mesh):
      return self._programs.step.lower(*args)

  def _compiled_step(self, args: tuple[Any, ...]) -> jax.stages.Compiled:
    compiled = self._programs.compiled
    leaves, treedef = jax.tree.flatten((args[4], args[6]))
    key = (*args[:2], treedef, tuple((x.shape, x.dtype) for x in leaves))
    if key not in compiled:
      compiled[key] = self._lower(args).compile(
          step_compiler_options(self.mesh))
      # Compiling leaves hundreds of MB of freed small allocations on the
      # heap; the step's own buffers come on top of what stays resident.
      release_free_heap()
    return compiled[key]

  def step(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
    """One optimizer step on a host batch; returns float metrics."""
    start = time.perf_counter()
    args = self._step_args(batch)
    group = args[1]
    step = self._compiled_step(args)
    # The mesh in context: the splash attention kernel shards itself over
    # it (`models.attention`).
    with jax.set_mesh(self.mesh):
      self.params, self.opt_state, stats = step(*args[2:])
    metrics = {k: float(v) for k, v in jax.device_get(stats).items()}
    if metrics["update_skipped"]:
      self.skipped_updates += 1
      logging.warning("non-finite loss %s / gradient norm %s: update "
                      "skipped (%d so far)", metrics["loss"],
                      metrics["grad_norm"], self.skipped_updates)
    metrics["skipped_updates_total"] = float(self.skipped_updates)
    metrics["prompt_group"] = float(group)
    seconds = time.perf_counter() - start
    metrics.update(step_time_s=seconds,
                   tokens_per_s=float(np.sum(batch["mask"])) / seconds)
    if "advantages" in batch:
      advantages = np.asarray(batch["advantages"], np.float64)
      metrics.update(advantage_mean=float(advantages.mean()),
                     advantage_std=float(advantages.std()),
                     advantage_abs_max=float(np.abs(advantages).max()))
    return metrics
