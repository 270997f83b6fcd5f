"""Ahead-of-time memory/FLOP plan of the trainer's own programs on a TPU
topology (or fake CPU devices).

  pip install -e ".[tpu]"       # libtpu: compiles for TPUs on any machine
  python -m tools.plan --config=configs/qwen3_4b_tpu.py --topology=v5p-8
  python -m tools.plan --config=configs/qwen3_4b_tpu.py --topology=cpu:8 \
      --mesh=fsdp:4,tensor:2 --length=4096 --batch=1,2 --budgets=16,32
  python -m tools.plan --config=configs/qwen3_4b_tpu.py --topology=v5p-8 --run
  python -m tools.plan --config=configs/qwen3_4b_tpu.py --topology=v5p-8 \
      --run --concurrency=8,32,64 --call_latency_s=3
  python -m tools.plan --config=configs/qwen3_4b_h20_vllm.py \
      --topology=v5p-16 --chip=h20 --run

Builds the GRPO step a `Trainer` of the config runs (`task.loop.grpo_step`:
its `Learner` with the loss config the trainer derives, its `Sampler` as
`rollout.decode_devices` places it) over abstract weights (no weights are
read or allocated), lowers the step's own programs (`rl.GRPOStep
.lower_rollout` / `.lower_update`: nothing here builds a program of its
own), compiles them with XLA for the topology's devices
(`jax.experimental.topologies`, as MaxText's `train_compile.py` does) and
prints one JSON line per program:

* `train`: the learner's update of a whole step (`rl.micro_batches`
  micro-batches scanned) at `max_prompt_tokens + max_new_tokens` tokens
  per row (default), `--batch` rows per chip in each micro-batch;
* `rollout`: the Sampler's generation program of one decoding wave:
  `--batch` prompts (sessions) per decoding chip prefilled into their
  shared prompt KV cache, then the `while_loop` decoding their
  `rollout.num_rollouts` rows each for `max_new_tokens` tokens
  (`decode_devices` "mesh": every chip holds its share of the rows and
  caches; "one": one device decodes the whole wave). Its `resident_gib` is
  the learner's state that stays allocated beside it (optimizer moments,
  the reference weights), and `fits` counts it;
* `cmi_kernel` (not among the defaults): `residual_cmi` for `--batch`
  rows per chip of `--cmi_shape` N,d memories (the batch sharded over every
  chip), float32.

The programs are the trainer's, not copies: tests/test_plan.py lowers
them both ways (here, and from a `Trainer`'s own step over real weights)
and checks the StableHLO is the same. Where the config's tokenizer is not
on this machine (the 4B configs name their checkpoint at run time), a
stand-in gives the architecture's EOS id (`stand_ins` in each line); a
vLLM config's rollouts are priced with the JAX sampler's program decoding
on the mesh.

Each line has XLA's per-chip memory (arguments, temporaries, outputs,
aliased, total) and `fits` against the chip's HBM, XLA's FLOPs and bytes
accessed (`xla_*`: XLA counts a loop body once, so the 36-layer scan
counts as one layer), the model's own per-chip FLOPs and minimum HBM
traffic (`model_*`: every layer, pass and token; `step_cost`) and the
roofline step time max(FLOPs / peak bf16 FLOP/s, bytes / HBM bandwidth)
from those and the chip's published figures (`CHIPS`, with their source).
With two or more `--batch` values, a summary line per program fits memory
as affine in rows per chip and gives the most rows per chip that fit.
`--topology=cpu:N` compiles for N fake CPU devices (memory layout differs
from TPUs: a plan, not a guarantee); they share the host's memory, so
each line also has `host_gib`, the process's peak RSS while the program
runs: the N devices' totals together (the resident state once, sharded;
whatever is replicated or all-gathered N times) plus `HOST_RUNTIME_GIB`,
what a training job holds outside JAX's arrays (interpreter, torch and
the tokenizer, compiled code, the data; measured, BENCHMARKS.md "Train
step memory").

`--run` costs the config's whole GRPO run before it starts. It compiles
the two programs at the run's rows per chip (`run_layout`: a
micro-batch's rows; a decoding wave's sessions per decoding chip) and
adds, with `run_cost` (pure arithmetic, tested on its own), per step: the
rollout (each wave's prefill, then `max_new_tokens` decoding steps that
read the weights and the whole KV cache: HBM-bound; the generation
program runs them in one `while_loop`, whose body XLA's cost analysis
counts once, so a decoding step's cost is the model's count of one step,
`program_cost`), the rewards (one CMI kernel call; the answer-model and
judge calls of every rollout all in flight at each endpoint's
concurrency, a verdict asked as soon as its answer arrives, as
`task.episode.RolloutScorer` sends them: `endpoint_rounds` rounds of
`--call_latency_s`; each wave's calls sent as soon as it is decoded, so
only what they outlast the decoding by counts
(`scoring_after_decoding`); the attribution weights of every rollout,
measured on this host), vLLM's old log-probs recomputed (one forward per
micro-batch, only with `rl.old_logprobs="sampler"`, beside the last
calls) and
the `rl.micro_batches` train calls (with `rl.share_prompts`, each
prompt's FLOPs once for its rows: `shared_train_cost`); times the steps
(`rl.epochs` passes over the sessions at `rl.sessions_per_batch` a step;
the sessions from the split's question ids x
`LONGMEMEVAL_SESSIONS_PER_DIALOGUE`, or `--sessions`). It prints a `run`
JSON line per `--concurrency` (`steps`, `per_step`, `step_s`, `hours`,
`chip_hours`, `fits`, `endpoint`: the concurrency, latency, the calls'
seconds alone and hidden, and the overlap assumed, `assumptions`: each
number's derivation) and the same as a table
on stderr. `--chip` prices the same programs on another chip's published
figures (`h20`: compiled for the 8 devices of a v5p-16, since there is no
GPU compiler here) or on this machine's measured ones (`host`).
`tools/scoring_check.py` checks the scoring stage's model, and its
overlap with decoding, against measured CPU steps.

Checked on this CPU against `configs/default.py`'s measured GRPO step
(`--topology=cpu:1 --preset=smollm2_135m --chip=host`; BENCHMARKS.md,
"The paper's run, costed"), 2 cores at load average 10-14: measured /
estimated was 0.99-1.14 for the learner step counted as the demo runs it
(each prompt once for its 2 rollouts; 0.56 for the whole rows the plan
compiles), 2.6 for the rollout (its decoding steps run far below the
copy bandwidth) and 1.3 for the step.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
import types

import ml_collections
import numpy as np
from absl import flags
from ml_collections import config_flags

from cmimem_jax.config import (define_command_line_flags, run_command,
                               validate_config)
from cmimem_jax.task.scoring_rounds import (endpoint_concurrency,
                                            endpoint_rounds,
                                            scoring_after_decoding)

GIB = 2.0 ** 30
# A training job's resident set outside JAX's arrays at its train step:
# one default.py GRPO step's peak RSS less its live arrays and the step's
# temporaries (4.40 - 2.24 - 1.27 GiB, BENCHMARKS.md "Train step memory").
HOST_RUNTIME_GIB = 0.9


@dataclasses.dataclass(frozen=True)
class Chip:
  """Published per-chip figures (bf16 dense peak, HBM size and bandwidth)."""
  hbm_gib: float
  peak_bf16_tflops: float
  hbm_gbytes_per_s: float
  source: str


CHIPS = {
    "v5p": Chip(95, 459, 2765, "https://cloud.google.com/tpu/docs/v5p"),
    "v6e": Chip(32, 918, 1640, "https://cloud.google.com/tpu/docs/v6e"),
    "v5e": Chip(16, 197, 819, "https://cloud.google.com/tpu/docs/v5e"),
    # NVIDIA publishes no data sheet for the H20 (Table 7's GPU); these are
    # the figures its partners and reviewers report: 148 TFLOP/s dense
    # FP16/BF16, 4.0 TB/s HBM3, 96 GB (= 89.4 GiB).
    "h20": Chip(96e9 / GIB, 148, 4000,
                "NVIDIA H20 96GB as reported by "
                "https://willitrunai.com/gpus/h20-96gb (no NVIDIA data "
                "sheet)"),
}


@dataclasses.dataclass(frozen=True)
class Topology:
  """A named TPU slice: `jax.experimental.topologies` arguments."""
  name: str
  chip: str
  chip_config: str


# One device per chip (v5p runs its two TensorCores as one: megacore).
TOPOLOGIES = {
    "v5p-8": Topology("v5:2x2x1", "v5p", "megacore"),
    "v5p-16": Topology("v5:2x2x2", "v5p", "megacore"),
    "v5p-32": Topology("v5:2x2x4", "v5p", "megacore"),
    "v6e-8": Topology("v6e:2x4", "v6e", "default"),
    "v6e-16": Topology("v6e:4x4", "v6e", "default"),
    "v5e-16": Topology("v5e:4x4", "v5e", "default"),
}


def _devices(topology: str):
  """(devices, Chip or None) of a topology name."""
  import jax
  if topology.startswith("cpu:"):
    return jax.devices("cpu")[:int(topology[4:])], None
  if topology not in TOPOLOGIES:
    raise SystemExit(f"--topology must be one of {sorted(TOPOLOGIES)} or "
                     f"cpu:N, got {topology!r}")
  spec = TOPOLOGIES[topology]
  from jax.experimental import topologies
  try:
    desc = topologies.get_topology_desc(platform="tpu",
                                        topology_name=spec.name,
                                        chip_config_name=spec.chip_config)
  except Exception as e:  # No libtpu, or one too old for this chip.
    raise SystemExit(f"cannot describe {topology} ({e}); is the TPU extra "
                     "installed? pip install -e \".[tpu]\"") from e
  return desc.devices, CHIPS[spec.chip]


def step_cost(c, program: str, rows: int, length: int, completion: int,
              passes: int, group: int) -> tuple[float, float]:
  """(FLOPs, minimum HBM bytes) of one program call for `rows` rows on one
  chip, counted from the architecture `c` (a `Qwen3Config`): matmuls
  2·in·out per token, causal attention 2·2·heads·head_dim per (query, key)
  pair, the LM head over the tokens whose logits are taken. `passes`: the
  layer stack's passes in a train step (forward, remat re-forward,
  backward x2, the KL reference's forward). Rollouts: `rows` prompts of
  `group` rows each. Bytes: the compute-dtype weights once per pass, plus
  the KV cache a rollout writes or reads (a prompt's once per group)."""
  q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
  hid = c.hidden_size
  layer = 2 * (hid * q + 2 * hid * kv + q * hid + 3 * hid * c.intermediate_size)
  attend = lambda queries, keys: 4 * c.num_attention_heads * c.head_dim * (  # noqa
      queries * keys)
  head = 2 * hid * c.vocab_size
  weights = (c.num_hidden_layers * layer / 2 + hid * c.vocab_size) * (
      np.dtype(c.compute_dtype).itemsize)
  cache_per_token = (2 * c.num_hidden_layers * kv
                     * np.dtype(c.compute_dtype).itemsize)
  L = c.num_hidden_layers
  if program == "train":
    flops = passes * L * rows * (layer * length + attend(length, length / 2))
    flops += (passes - 1) * rows * completion * head  # No remat of the head.
    return flops, passes * weights
  if program == "rollout_prefill":
    prompt = length - completion
    flops = L * rows * (layer * prompt + attend(prompt, prompt / 2)) + (
        rows * head)
    return flops, weights + rows * prompt * cache_per_token
  if program == "cmi_kernel":  # `length` = N, `completion` = d.
    n, d = length, completion
    # The Gram of N + 2 rows, the anchored products, float32 reads.
    return (2.0 * rows * d * ((n + 2) ** 2 + 2 * n + 4),
            4.0 * rows * d * (n + 2))
  # rollout_decode: one token per row over its prompt's and its own cache.
  decoded = rows * group
  flops = L * decoded * (layer + attend(1, length)) + decoded * head
  return flops, weights + (rows * (length - completion) + decoded * (
      completion)) * cache_per_token


def program_cost(c, name: str, per_chip: int, length: int, completion: int,
                 passes: int, group: int, cmi_shape: tuple[int, int],
                 prompt_group: int = 1
                 ) -> tuple[tuple[float, float], dict[str, tuple[float,
                                                              float]]]:
  """(FLOPs, HBM bytes) per chip of one call of `lower_program`'s `name`,
  and of the parts `run_cost` times: "train" one micro-batch (each prompt
  once for its `prompt_group` rows, `shared_train_cost`); "rollout"
  the generation program's prefill of the wave's prompts
  ("rollout_prefill") and one decoding step of its rows
  ("rollout_decode"; the program runs `completion` of them in its
  `while_loop`, which XLA's cost analysis counts once); "cmi_kernel" the
  kernel call."""
  if name == "rollout":
    prefill = step_cost(c, "rollout_prefill", per_chip, length, completion,
                        passes, group)
    decode = step_cost(c, "rollout_decode", per_chip, length, completion,
                       passes, group)
    total = (prefill[0] + completion * decode[0],
             prefill[1] + completion * decode[1])
    return total, {"rollout_prefill": prefill, "rollout_decode": decode}
  if name == "cmi_kernel":
    cost = step_cost(c, name, per_chip, *cmi_shape, passes, group)
  elif name == "encoder":  # `c`: the encoder's; one forward, no LM head.
    cost = step_cost(c, "train", per_chip, length, 0, 1, 1)
  elif name == "train":
    cost = shared_train_cost(c, per_chip, length, completion, passes,
                             prompt_group)
  else:
    cost = step_cost(c, name, per_chip, length, completion, passes, group)
  return cost, {name: cost}


def measure(compiled, chip, cost: tuple[float, float],
            resident: int = 0) -> dict:
  """Per-chip memory, XLA's and the model's cost, and the roofline of a
  compiled program; `resident`: bytes per chip that stay allocated beside
  it (`resident_bytes`), added to its total for `fits`."""
  memory = compiled.memory_analysis()
  xla = compiled.cost_analysis()
  xla = (xla[0] if isinstance(xla, list) else xla) or {}
  total = (memory.argument_size_in_bytes + memory.temp_size_in_bytes
           + memory.output_size_in_bytes - memory.alias_size_in_bytes)
  flops, accessed = cost
  row = {
      "arguments_gib": round(memory.argument_size_in_bytes / GIB, 3),
      "temporaries_gib": round(memory.temp_size_in_bytes / GIB, 3),
      "outputs_gib": round(memory.output_size_in_bytes / GIB, 3),
      "aliased_gib": round(memory.alias_size_in_bytes / GIB, 3),
      "total_gib": round(total / GIB, 3),
      "xla_tflops": round(float(xla.get("flops", 0.0)) / 1e12, 3),
      "xla_bytes_accessed_gib": round(
          float(xla.get("bytes accessed", 0.0)) / GIB, 3),
      "model_tflops": round(flops / 1e12, 3),
      "model_bytes_gib": round(accessed / GIB, 3)}
  if resident:
    row["resident_gib"] = round(resident / GIB, 3)
    row["with_resident_gib"] = round((total + resident) / GIB, 3)
  if chip is not None:
    seconds, bound = roofline(cost, chip)
    row.update(roofline_s=round(seconds, 4), bound=bound,
               hbm_gib=round(chip.hbm_gib, 3),
               fits=total + resident <= chip.hbm_gib * GIB)
  return row


def roofline(cost: tuple[float, float], chip: Chip) -> tuple[float, str]:
  """(seconds, "compute" | "memory") of (FLOPs, HBM bytes) on one chip:
  max(FLOPs / peak FLOP/s, bytes / HBM bandwidth)."""
  flops, accessed = cost
  compute_s = flops / (chip.peak_bf16_tflops * 1e12)
  memory_s = accessed / (chip.hbm_gbytes_per_s * 1e9)
  return max(compute_s, memory_s), ("compute" if compute_s >= memory_s
                                    else "memory")


# --- the whole run (--run) -------------------------------------------------

# Table 5: the RL split's 50 LongMemEval (longmemeval_s) dialogues hold
# ~2,400 sessions, and 5 synthesized QA pairs per session (12,000 in all;
# `tools/synthesize_qa.py --per_session`).
LONGMEMEVAL_SESSIONS_PER_DIALOGUE = 48
QA_PER_SESSION = 5
# The programs a run's step is made of, compiled at the run's rows per chip.
RUN_PROGRAMS = ("train", "rollout")


@dataclasses.dataclass(frozen=True)
class RunShape:
  """What a GRPO run does (`task.loop.Trainer`), counted from its config:
  a step samples `sessions_per_step x rollouts` rows in `waves` decoding
  waves of whole sessions (the last may hold fewer) of
  `completion_tokens` tokens (every row runs to the cap), scores every
  rollout, then takes `micro_batches` train-program calls."""
  sessions: int           # Training sessions in one pass (an epoch).
  epochs: int
  sessions_per_step: int
  max_steps: int          # 0: `epochs` passes decide.
  rollouts: int           # Per session.
  micro_batches: int
  completion_tokens: int
  waves: int
  # Answer-model calls per rollout (each then judged; 0 without the LLM
  # judge), the calls in flight at the slower endpoint, one call's seconds.
  questions: int
  concurrency: int
  call_latency_s: float
  chips: int
  # Host seconds of a step outside the endpoints (measured: the
  # attribution weights of every rollout, `host_seconds`).
  host_s: float = 0.0
  # A wave's calls are sent as soon as it is decoded, while the next
  # waves decode (`rollout.score_beside_decoding`); False: after the last.
  score_beside_decoding: bool = True

  def wave_calls(self) -> list[int]:
    """Answer calls of each decoding wave: its sessions' rollouts x
    `questions` (the waves hold ceil(sessions_per_step / waves) sessions,
    the last the rest)."""
    per_wave = -(-self.sessions_per_step // self.waves)
    sessions = [min(per_wave, self.sessions_per_step - w * per_wave)
                for w in range(self.waves)]
    return [s * self.rollouts * self.questions for s in sessions]

  @property
  def steps(self) -> int:
    """`Curriculum.planned_steps`: whole passes, the last batch may run
    into a further pass; `max_steps` overrides."""
    return self.max_steps or -(-self.epochs * self.sessions
                               // self.sessions_per_step)


def run_cost(shape: RunShape, seconds: dict[str, float]) -> dict:
  """The run's time from one call of each program (`seconds`, per chip,
  the chips in parallel): "rollout_prefill" (one wave's prompts),
  "rollout_decode" (one token of one wave's rows), "train" (one
  micro-batch), "recompute" (one micro-batch's forward for old log-probs;
  0 where the sampler gives them) and "cmi_kernel" (a step's CMI terms).

  A step runs as `Trainer.step` runs it: the waves decode one after
  another while each decoded wave's endpoint calls are in flight
  (`scoring_after_decoding`); after the last wave the learner recomputes
  old log-probs with the last calls still in flight, so
  `reward_endpoint_s` is what the calls outlast the decoding and the
  recompute by; then the CMI kernel, the host work and the update, one
  after another. A step is the sum of `per_step`; `endpoint_s` all the
  calls alone (the stage before the overlap), `endpoint_hidden_s` what
  decoding and the recompute hid of it; `hours` the steps' total,
  `chip_hours` that times the chips held."""
  wave_s = (seconds["rollout_prefill"]
            + shape.completion_tokens * seconds["rollout_decode"])
  calls = shape.wave_calls()
  recompute_s = shape.micro_batches * seconds["recompute"]
  after = scoring_after_decoding(calls, shape.concurrency,
                                 shape.call_latency_s, wave_s,
                                 shape.score_beside_decoding)
  endpoint_s = scoring_after_decoding(calls, shape.concurrency,
                                      shape.call_latency_s, wave_s,
                                      beside=False)
  per_step = {
      "rollout_prefill_s": shape.waves * seconds["rollout_prefill"],
      "rollout_decode_s": (shape.waves * shape.completion_tokens
                           * seconds["rollout_decode"]),
      "reward_cmi_s": seconds["cmi_kernel"],
      "reward_endpoint_s": max(0.0, after - recompute_s),
      "reward_host_s": shape.host_s,
      "recompute_logprobs_s": recompute_s,
      "train_s": shape.micro_batches * seconds["train"]}
  step_s = sum(per_step.values())
  hours = shape.steps * step_s / 3600
  return {"steps": shape.steps,
          "per_step": {k: round(v, 6) for k, v in per_step.items()},
          "step_s": round(step_s, 6), "hours": round(hours, 3),
          "chip_hours": round(hours * shape.chips, 3), "chips": shape.chips,
          "endpoint_s": round(endpoint_s, 6),
          "endpoint_hidden_s": round(endpoint_s
                                     - per_step["reward_endpoint_s"], 6)}


def run_layout(config, chips: int, decoding_chips: int) -> dict[str, int]:
  """Rows per chip of each program in the config's run on `chips` chips:
  "train" a micro-batch's training rows (a share that does not divide
  rounds up); "rollout" a decoding wave's prompts on each of the
  `decoding_chips` that decode (`Sampler.wave_rows`: whole groups x
  decoding chips, at most `rollout.max_rows_per_wave` rows; prompts
  padded to a multiple of the decoding chips); "waves" the waves of a
  step."""
  from cmimem_jax.sampling.sampler import wave_rows
  rl, rollout = config.rl, config.rollout
  group = rollout.num_rollouts
  rows = rl.sessions_per_batch * group
  wave = min(wave_rows(rows, group, decoding_chips,
                       rollout.max_rows_per_wave), rows)
  prompts = wave // group
  return {"train": -(-rows // (rl.micro_batches * chips)),
          "rollout": -(-prompts // decoding_chips),
          "waves": -(-rl.sessions_per_batch // prompts)}


def host_seconds(rollouts: int, response_tokens: int) -> tuple[float, str]:
  """(seconds, how) of a step's host work that scales with the responses,
  measured here: each rollout's attribution weights
  (`task.episode.attribution_weights`: incremental detokenization and a
  binary search over the lines) for a DSL response of `response_tokens`
  tokens, in the embedded SmolLM2 tokenizer (a byte-level BPE, as
  Qwen3's), best of 3, times the rollouts."""
  from cmimem_jax.sampling import ChatPolicy, load_tokenizer
  from cmimem_jax.task.episode import attribution_weights
  policy = ChatPolicy.__new__(ChatPolicy)  # Its decoding needs no model.
  policy.tokenizer = load_tokenizer("")
  line = "EPISODIC:ADD|2023-05-08: the user walked Rex, a beagle, at 7 am\n"
  text = line * (1 + response_tokens // 8)
  tokens = policy.tokenizer.encode(text, add_special_tokens=False)[
      :response_tokens]
  spans, start = [], 0
  for piece in text.split("\n"):
    spans.append(((start, start + len(piece)), 2.0))
    start += len(piece) + 1
  terms = type("Terms", (), {"line_weights": spans})
  times = []
  for _ in range(3):
    begin = time.perf_counter()
    attribution_weights(terms, policy.decode, tokens, response_tokens,
                        policy.decode_each)
    times.append(time.perf_counter() - begin)
  one = min(times)
  return rollouts * one, (f"{rollouts} rollouts x {one * 1e3:.1f} ms: "
                          f"attribution weights of a {response_tokens}-token "
                          "response, measured on this host (SmolLM2's "
                          "tokenizer), serial after the scoring stage")


def run_sessions(config, sessions: int) -> tuple[int, str]:
  """(training sessions of one pass, where the count comes from):
  `sessions` if given, else the LongMemEval split's dialogues (the
  bundled question ids) x `LONGMEMEVAL_SESSIONS_PER_DIALOGUE`, less the
  held-out `rl.validation_sessions`."""
  held_out = config.rl.validation_sessions
  if sessions:
    return sessions - held_out, f"--sessions={sessions}"
  from cmimem_jax.data import longmemeval_split_ids
  dataset = config.dataset
  if dataset.name != "longmemeval" or dataset.split not in ("sft", "rl",
                                                            "test"):
    raise SystemExit(f"--run: dataset {dataset.name!r} split "
                     f"{dataset.split!r} has no known session count; pass "
                     "--sessions=N")
  dialogues = len(longmemeval_split_ids(dataset.split))
  return (dialogues * LONGMEMEVAL_SESSIONS_PER_DIALOGUE - held_out,
          f"{dialogues} dialogues of LongMemEval's {dataset.split} split x "
          f"{LONGMEMEVAL_SESSIONS_PER_DIALOGUE} sessions (Table 5: ~2,400 "
          f"in 50), less {held_out} held out")


def host_chip(dtype: str) -> Chip:
  """This host's measured peak, as a `Chip`: the best of five 2048^2
  `dtype` matmuls (FLOP/s) and of five in-place elementwise passes over
  256 MiB (read + write bytes/s), on JAX's first CPU device."""
  import jax
  import jax.numpy as jnp
  n, size = 2048, 2 ** 26
  a = jnp.ones((n, n), dtype)
  matmul = jax.jit(jnp.dot)
  # Donated: a fresh 256 MiB output per pass would time its page faults
  # (2.3 GB/s here, against 26 GB/s in place).
  scale = jax.jit(lambda v: v * 2.0, donate_argnums=0)
  x = jnp.ones((size,), jnp.float32)

  def best(fn) -> float:
    fn().block_until_ready()
    times = []
    for _ in range(5):
      start = time.perf_counter()
      fn().block_until_ready()
      times.append(time.perf_counter() - start)
    return min(times)

  def step():
    nonlocal x
    x = scale(x)
    return x

  tflops = 2 * n ** 3 / best(lambda: matmul(a, a)) / 1e12
  gbytes = 2 * 4 * size / best(step) / 1e9
  return Chip(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB,
              round(tflops, 3), round(gbytes, 1),
              f"measured on this host ({os.cpu_count()} cores): {dtype} "
              f"{n}^2 matmul, f32 pass over 256 MiB in place, best of 5")


def run_table(run: dict) -> str:
  """The run as a Markdown table: each number beside its assumption."""
  lines = ["| quantity | value | assumption |", "|---|---|---|"]
  for name, value in [("steps", run["steps"]), *run["per_step"].items(),
                      ("step_s", run["step_s"]), ("hours", run["hours"]),
                      ("chip_hours", run["chip_hours"])]:
    lines.append(f"| {name} | {value} | "
                 f"{run['assumptions'].get(name, '')} |")
  return "\n".join(lines)


def _pass_names(model_config, rl) -> list[str]:
  """The layer stack's passes of a train step, as `main` counts them."""
  return (["forward", "backward x2"]
          + (["remat re-forward"] if model_config.remat != "none" else [])
          + (["KL reference forward"] if rl.kl_beta > 0 else []))


def shared_train_cost(c, rows: int, length: int, completion: int,
                      passes: int, group: int) -> tuple[float, float]:
  """`step_cost`'s "train" when each prompt runs once for its `group`
  rows (`Qwen3.shared_prompt_hidden_states`): rows / group prompts of
  `length - completion` tokens (causal), and the rows' `completion`
  tokens each over its prompt and itself. On the splash kernel the
  prompt and each row are padded to its block (`grouped_rows_layout`):
  the layers' matmuls run over the padded columns too."""
  if group == 1:
    return step_cost(c, "train", rows, length, completion, passes, 1)
  from cmimem_jax.models.attention import grouped_rows_layout, resolve_impl
  q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
  hid = c.hidden_size
  layer = 2 * (hid * q + 2 * hid * kv + q * hid + 3 * hid * c.intermediate_size)
  pair = 4 * c.num_attention_heads * c.head_dim  # Per (query, key).
  prompt, prompts = length - completion, rows / group
  prompt_columns, row_columns = prompt, completion
  if resolve_impl(c.attention_impl, completion, c.compute_dtype) == "splash":
    prompt_columns, row_columns = grouped_rows_layout(prompt, completion)
  flops = passes * c.num_hidden_layers * (
      prompts * (layer * prompt_columns + pair * prompt * prompt / 2)
      + rows * (layer * row_columns
                + pair * completion * (prompt + completion / 2)))
  flops += (passes - 1) * rows * completion * 2 * hid * c.vocab_size
  return flops, step_cost(c, "train", rows, length, completion, passes, 1)[1]


def _run(args, config, model_config, chip: Chip, layout: dict[str, int],
         seconds: dict[str, float], compiled: list[dict], passes: int,
         length: int, completion: int, group: int) -> list[dict]:
  """The `run` lines of `--run`, one per `--concurrency`: `run_cost` of
  the compiled programs' roofline seconds (the train program's FLOPs
  with `group` rows per shared prompt, `GRPOStep.update_prompt_group`),
  the CMI kernel's and the old log-probs' recompute from the same model
  count, the measured host work, every assumption beside its number."""
  rl, rollout = config.rl, config.rollout
  chips = compiled[0]["devices"]
  sessions, source = run_sessions(config, args.sessions)
  rollouts = rl.sessions_per_batch * rollout.num_rollouts
  conditioning = config.reward.conditioning
  n, d = conditioning.top_k + conditioning.n_recent, config.encoder.dim
  cmi_rows = -(-rollouts * args.cmi_ops // chips)
  seconds["cmi_kernel"] = roofline(step_cost(
      model_config, "cmi_kernel", cmi_rows, n, d, passes, 1), chip)[0]
  # vLLM's log-probs as the old ones (rl.old_logprobs="sampler") are
  # recomputed by the learner: one forward per micro-batch.
  recompute = rollout.engine == "vllm" and rl.old_logprobs == "sampler"
  seconds["recompute"] = seconds["train"] / passes if recompute else 0.0
  host_s, host_how = (host_seconds(rollouts, completion)
                      if args.host_s_per_rollout < 0 else
                      (rollouts * args.host_s_per_rollout,
                       f"{rollouts} rollouts x {args.host_s_per_rollout} s "
                       "(--host_s_per_rollout)"))
  prompt = length - completion
  steps = (f"rl.max_steps={rl.max_steps}" if rl.max_steps else
           f"ceil({max(1, rl.epochs)} epochs x {sessions} sessions / "
           f"{rl.sessions_per_batch} per step)")
  concurrencies = ([int(c) for c in args.concurrency.split(",")]
                   if args.concurrency else [0])
  from cmimem_jax.task.qa_reward import QAConfig
  runs = []
  qa = QAConfig.from_config(config.qa)
  llm = qa.judge == "llm"
  beside = rollout.score_beside_decoding
  waves = layout["waves"]
  for concurrency in concurrencies:
    rounds = endpoint_rounds(qa, rollouts, QA_PER_SESSION, concurrency)
    answer_c, judge_c = endpoint_concurrency(qa, concurrency)
    shape = RunShape(sessions, max(1, rl.epochs), rl.sessions_per_batch,
                     rl.max_steps, rollout.num_rollouts, rl.micro_batches,
                     completion, waves, QA_PER_SESSION if llm else 0,
                     min(answer_c, judge_c), args.call_latency_s, chips,
                     host_s, beside)
    run = run_cost(shape, seconds)
    scoring_s, hidden_s = run.pop("endpoint_s"), run.pop("endpoint_hidden_s")
    wave_calls = shape.wave_calls()
    overlap = (
        "every answer and judge call of a step in flight together, each "
        "endpoint at its concurrency for the whole step, a verdict asked "
        "as soon as its answer arrives (task.episode.RolloutScorer); ")
    if beside and waves > 1:
      overlap += (
          f"each of the {waves} decoding waves' calls sent as soon as it is "
          "decoded, while the next waves decode "
          "(rollout.score_beside_decoding, rl.GRPOStep); after the last "
          "wave what remains is max over waves w of [the rounds of the "
          "calls of waves w.. x the latency - the decoding after wave w] "
          "(task.scoring_rounds.scoring_after_decoding). Not counted: the "
          "host work of applying a wave before its calls go out, during which "
          "the chips idle where scoring needs them (an in-process encoder, "
          "the policy as core compressor: the next wave is dispatched "
          "after it)")
    else:
      overlap += ("the calls sent after the "
                  + ("only decoding wave" if waves == 1 else "last wave "
                     "(rollout.score_beside_decoding=False)")
                  + ", none beside decoding")
    if recompute:
      overlap += ("; the learner's old log-probs are recomputed while the "
                  "last calls are in flight")
    overlap += "; the update after the last verdict"
    endpoint = {
        "answer_concurrency": answer_c if llm else None,
        "judge_concurrency": judge_c if llm else None,
        "call_latency_s": args.call_latency_s if llm else None,
        "scoring_s": scoring_s if llm else None,
        "hidden_s": hidden_s if llm else None,
        "overlap": overlap if llm else "no endpoint calls"}
    assumptions = {
        "steps": f"{steps}; sessions: {source}",
        "rollout_prefill_s": (
            f"{layout['waves']} waves x {seconds['rollout_prefill']:.4g} s: "
            f"the Sampler's generation program's prefill, "
            f"{layout['rollout']} prompts/chip of {prompt} tokens"),
        "rollout_decode_s": (
            f"{layout['waves']} waves x {completion} tokens (every rollout "
            f"to the cap) x {seconds['rollout_decode']:.4g} s: one step of "
            "the generation program's decode loop, "
            f"{layout['rollout'] * rollout.num_rollouts} rows/chip, "
            "each step reads the weights and the whole allocated KV cache "
            f"({prompt} shared prompt + {completion} own tokens)"),
        "reward_cmi_s": (
            f"{rollouts} rollouts x {args.cmi_ops} scored operations "
            f"(--cmi_ops), N = {n}, d = {d}, float32, one kernel call"),
        "reward_endpoint_s": (
            f"the calls' {endpoint['scoring_s']:.4g} s alone ({rounds} "
            f"rounds x {args.call_latency_s} s a call (--call_latency_s): "
            f"ceil({rollouts} rollouts x {QA_PER_SESSION} questions / "
            f"min(answer {answer_c}, judge {judge_c}) in flight) + 1, the "
            "last verdicts; every rollout valid), less the "
            f"{endpoint['hidden_s']:.4g} s hidden behind decoding"
            + (f" ({waves} waves of {', '.join(map(str, wave_calls))} "
               "calls, each sent as it is decoded)"
               if beside and waves > 1 else "")
            + (" and the old log-probs' recompute" if recompute else "")
            if rounds else f"qa.judge={config.qa.judge}: no endpoint"),
        "reward_host_s": host_how,
        "recompute_logprobs_s": (
            f"rollout.engine=vllm, rl.old_logprobs=sampler: "
            f"{rl.micro_batches} micro-batches x one forward (the train "
            f"program / {passes} passes)" if recompute else
            "0: the learner's own log-probs under stop_gradient "
            "(rl.old_logprobs=learner) or the JAX sampler's"),
        "train_s": (
            f"{rl.micro_batches} micro-batches x {seconds['train']:.4g} s: "
            f"{layout['train']} rows/chip of {length} tokens, {passes} layer "
            f"passes ({', '.join(_pass_names(model_config, rl))})"
            + (f"; rl.share_prompts: each prompt once for its {group} rows "
               "(the compiled program's model FLOPs)" if group > 1 else
               "; whole rows")),
        "step_s": "the stages' sum (Trainer.step: the endpoint calls "
                  "overlap the decoding and recompute as reward_endpoint_s "
                  "says, nothing else overlaps); no compile, checkpoint, "
                  "encoder or memory-edit time",
        "hours": (f"roofline: max(model FLOPs / {chip.peak_bf16_tflops:g} "
                  f"TFLOP/s, model HBM bytes / {chip.hbm_gbytes_per_s:g} "
                  f"GB/s) per program ({chip.source}); XLA's cost_analysis "
                  "counts the scanned layer once, so FLOPs and bytes are "
                  "the model's count of each compiled program "
                  "(tests/test_plan.py checks the two agree for one layer)"),
        "chip_hours": f"hours x {chips} chips ({args.topology}"
                      f"{', ' + args.chip if args.chip else ''})"}
    runs.append({"program": "run", "config": args.config,
                 "sessions": sessions, **run, "endpoint": endpoint,
                 "prompt_group": group,
                 "fits": {r["program"]: r.get("fits") for r in compiled},
                 "assumptions": assumptions})
  return runs


class _StandInTokenizer:
  """What the trainer's programs take of a tokenizer (EOS and pad ids),
  where the config's own is not on this machine (an HF checkpoint path
  left for the run, as the 4B configs do)."""

  def __init__(self, eos_token_id: int, pad_token_id: int = 0):
    self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id


def _tokenizer(policy, checkpoint: str, eos) -> tuple[object, str]:
  """(the tokenizer the trainer would load, where it came from): the
  config's (or `--checkpoint`'s) when it is here; else a stand-in with
  the architecture's EOS id (pad 0), which changes no shape."""
  from cmimem_jax.sampling import (checkpoint_tokenizer_path, load_tokenizer,
                                   policy_tokenizer_path)
  named = checkpoint or policy.tokenizer or policy.path or (
      policy.source != "hf")
  if named:
    try:
      path = (checkpoint_tokenizer_path(checkpoint) if checkpoint
              else policy_tokenizer_path(policy))
      return load_tokenizer(path), "the config's"
    except (OSError, ValueError):
      pass
  eos = eos[0] if isinstance(eos, (tuple, list)) else eos
  return (_StandInTokenizer(int(eos or 0)),
          "stand-in: the architecture's EOS id, pad 0")


def trainer_step(config, mesh, preset_name: str = "", checkpoint: str = "",
                 layers: int = 0, completion: int = 0):
  """The trainer's GRPO step (`task.loop.grpo_step`: its learner, its
  rollout engine and their configs) over abstract weights on `mesh`:
  nothing is allocated, its programs are only lowered. The architecture is
  the policy's as the trainer loads it (a random policy's vocabulary is its
  tokenizer's), or `preset_name` / `checkpoint`'s config.json, with
  `layers` layers (0: all); `completion`: `rollout.max_new_tokens` (0:
  the config's). A vLLM config's rollouts are priced with the JAX
  sampler's program decoding on the mesh (vLLM's own is not XLA's).

  Returns:
    (the `rl.GRPOStep`, its `Qwen3Config`, notes on what stood in).
  """
  from cmimem_jax.models.qwen3 import Qwen3Config, preset
  from cmimem_jax.models.qwen3.params import abstract_model
  from cmimem_jax.sampling.policy import (PolicyConfig, policy_runtime,
                                          random_policy_config)
  from cmimem_jax.task.loop import GRPO_STEP_SECTIONS, grpo_step
  config = config.copy_and_resolve_references()
  policy = PolicyConfig.from_config(config.policy)
  runtime = policy_runtime(policy)
  if layers:
    runtime["num_hidden_layers"] = layers
  if completion:
    config.rollout.max_new_tokens = completion
  notes = {}
  if config.rollout.engine != "jax":
    notes["engine"] = (f"rollout.engine={config.rollout.engine}: the JAX "
                       "sampler's program decoding on the mesh stands in")
    config.rollout.engine, config.rollout.decode_devices = "jax", "mesh"
  # A random policy's vocabulary is its tokenizer's (`load_policy`).
  random = policy.source == "random" and not (checkpoint or preset_name)
  if checkpoint:
    model_config = Qwen3Config.from_pretrained(checkpoint, **runtime)
  elif not random:
    # An HF / GGUF policy: the architecture the config names
    # (`policy.preset`; configs/paper.py).
    model_config = preset(preset_name or policy.preset, **runtime)
  tokenizer, notes["tokenizer"] = _tokenizer(
      policy, checkpoint, None if random else model_config.eos_token_id)
  if random:
    model_config = random_policy_config(policy, len(tokenizer), **(
        {"num_hidden_layers": layers} if layers else {}))
  # The plan loads no snapshots: their directory need not exist here.
  config.rl.snapshots = "policy"
  sections = validate_config(config, GRPO_STEP_SECTIONS)
  step = grpo_step(sections, abstract_model(model_config), tokenizer, mesh)
  return step, model_config, notes


def lower_program(step, name: str, per_chip: int, length: int,
                  completion: int, cmi_shape: tuple[int, int] = (20, 1024),
                  encoder=None):
  """`name`'s program lowered at `per_chip` rows on each chip that runs
  it: "train" the step's update (`per_chip` rows of each of the
  `rl.micro_batches` micro-batches on each batch shard, rows of `length`
  tokens, the last `completion` the rollout's), "rollout" the engine's
  generation program of one wave (`per_chip` prompts on each decoding
  chip, `group` rollouts each, prompt bucket `length - completion`),
  "encoder" the in-process encoder's largest program (`plan_encoder` of
  the config's `encoder` section: one batch of its own size on one
  device), "cmi_kernel" `residual_cmi` on `per_chip` rows per chip of
  `cmi_shape` (N, d) memories."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P

  from cmimem_jax.parallel import BATCH_AXES
  if name == "train":
    rows = per_chip * step.learner.shards * step.learner.config.micro_batches
    return step.lower_update(rows, length - completion)
  if name == "rollout":
    return step.lower_rollout(per_chip * step.engine.row_shards,
                              length - completion)
  if name == "encoder":
    return encoder.lower()
  if name == "cmi_kernel":
    from cmimem_jax.cmi.kernel import residual_cmi_unchecked
    mesh = step.learner.mesh
    batch = per_chip * mesh.devices.size
    n, d = cmi_shape
    sharded = lambda *dims: jax.ShapeDtypeStruct(  # noqa: E731
        dims[1:], dims[0], sharding=NamedSharding(mesh, P(
            BATCH_AXES, *([None] * (len(dims) - 2)))))
    return jax.jit(residual_cmi_unchecked).lower(
        sharded(jnp.float32, batch, d), sharded(jnp.float32, batch, d),
        sharded(jnp.float32, batch, n, d), sharded(jnp.bool_, batch, n))
  raise SystemExit(f"unknown program {name!r}; known: {sorted(PROGRAMS)}")


# What `--programs` may name (`lower_program`).
PROGRAMS = ("train", "rollout", "encoder", "cmi_kernel")
# The architecture of Qwen3-Embedding-0.6B (`encoder.kind =
# "qwen3_embedding"`, the 4B configs' in-process encoder).
QWEN3_EMBEDDING_PRESET = "qwen3_0p6b"


def first_device(mesh):
  """`mesh`'s first device as a mesh of the same axes (each of size 1):
  where the trainer's encoder runs."""
  import jax
  return jax.sharding.Mesh(mesh.devices.flat[:1].reshape(
      (1,) * mesh.devices.ndim), mesh.axis_names)


def plan_encoder(encoder: ml_collections.ConfigDict, mesh, layers: int = 0):
  """The trainer's in-process encoder (`encoders.make_encoder` of the
  config's `encoder` section: Qwen3-Embedding, loaded as `load_hf` loads
  it, on the default device) over abstract weights on `mesh`'s first
  device; SystemExit for an encoder that runs no program of ours. The
  raw section, not an `EncoderConfig`: its `path` (a checkpoint the plan
  never reads) need not exist here."""
  import jax
  from jax.sharding import NamedSharding, PartitionSpec as P

  from cmimem_jax.encoders import query_instruction
  from cmimem_jax.encoders.neural import Qwen3EmbeddingEncoder
  from cmimem_jax.models.qwen3 import preset
  from cmimem_jax.models.qwen3.params import abstract_model
  from flax import nnx
  if encoder.kind != "qwen3_embedding":
    raise SystemExit(f"--programs=encoder: encoder.kind={encoder.kind!r} "
                     "runs no compiled program here (qwen3_embedding does)")
  model = abstract_model(preset(QWEN3_EMBEDDING_PRESET, **(
      {"num_hidden_layers": layers} if layers else {})), lm_head=False)
  one = NamedSharding(first_device(mesh), P())
  state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=one), nnx.state(model))
  return Qwen3EmbeddingEncoder("", query_instruction(encoder),
                               model=nnx.merge(nnx.graphdef(model), state))


def resident_bytes(step, name: str) -> int:
  """Per-chip bytes of the learner's state that stays resident while
  `name` runs but is not among its arguments: during a rollout the
  optimizer state and the reference weights (the policy's weights are the
  program's own arguments); beside the encoder (rewards are scored between
  the rollout, whose KV buffers are freed first, and the update) all of
  it."""
  import jax
  learner = step.learner
  if name == "rollout":
    leaves = jax.tree.leaves((learner.opt_state, learner.ref_params))
  elif name == "encoder":  # Beside the learner's whole state, on one chip.
    leaves = jax.tree.leaves((learner.params, learner.opt_state,
                              learner.ref_params))
  else:
    return 0
  return sum(int(np.prod(x.sharding.shard_shape(x.shape)))
             * np.dtype(x.dtype).itemsize for x in leaves
             if hasattr(x, "sharding"))


# This tool's flags (its own: tools share flag names).
FLAGS = flags.FlagValues()
define_command_line_flags(workdir=False, flag_values=FLAGS)
flags.DEFINE_string("topology", "cpu:8",
                    f"One of {sorted(TOPOLOGIES)} or cpu:N.",
                    flag_values=FLAGS)
flags.DEFINE_string("mesh", "", "Mesh axes (default: fsdp over every "
                    "device).", flag_values=FLAGS)
flags.DEFINE_string("programs", "train,rollout",
                    f"Comma separated, of {PROGRAMS}.", flag_values=FLAGS)
flags.DEFINE_string("batch", "1", "Per chip, comma separated: training rows "
                    "of a micro-batch; rollout prompts of a wave (each with "
                    "rollout.num_rollouts rows).", flag_values=FLAGS)
flags.DEFINE_string("length", "", "Prompt + completion tokens, comma "
                    "separated (default: the config's max_prompt_tokens + "
                    "max_new_tokens).", flag_values=FLAGS)
flags.DEFINE_integer("completion", 0, "Completion tokens (default: the "
                     "config's max_new_tokens, capped at a quarter of "
                     "--length).", flag_values=FLAGS)
flags.DEFINE_string("budgets", "", "Per-chip GiB budgets for the fit "
                    "(default: the chip's HBM; cpu: 16,32,95).",
                    flag_values=FLAGS)
flags.DEFINE_string("preset", "", "Override policy.preset (another "
                    "architecture at the config's dtype / remat).",
                    flag_values=FLAGS)
flags.DEFINE_string("checkpoint", "", "The architecture of this HF "
                    "checkpoint directory (its config.json) instead of the "
                    "config's preset, e.g. the rehearsal's stand-in policy.",
                    flag_values=FLAGS)
flags.DEFINE_integer("layers", 0, "Override the layer count (smoke tests).",
                     flag_values=FLAGS)
flags.DEFINE_string("cmi_shape", "20,1024", "N,d of the cmi_kernel "
                    "program's memories.", flag_values=FLAGS)
flags.DEFINE_bool("markdown", False, "Also print the compiled programs as a "
                  "table.", flag_values=FLAGS)
flags.DEFINE_bool("run", False, "Cost the config's whole GRPO run: compile "
                  "its programs at the run's rows per chip (replaces "
                  "--programs and --batch) and print a `run` line (hours, "
                  "chip_hours, assumptions) and a table.", flag_values=FLAGS)
flags.DEFINE_integer("sessions", 0, "--run: training sessions of one pass "
                     "(default: the LongMemEval split's dialogues x "
                     f"{LONGMEMEVAL_SESSIONS_PER_DIALOGUE}).",
                     flag_values=FLAGS)
flags.DEFINE_float("call_latency_s", 3.0, "--run: seconds of one "
                   "answer-model or judge call at the endpoint.",
                   flag_values=FLAGS)
flags.DEFINE_string("concurrency", "", "--run: answer and judge calls in "
                    "flight per endpoint, comma separated: a run line each "
                    "(default: the config's qa.answer / qa.judge_endpoint "
                    "concurrency).", flag_values=FLAGS)
flags.DEFINE_float("host_s_per_rollout", -1.0, "--run: host seconds per "
                   "rollout (default -1: measure the attribution weights "
                   "here).", flag_values=FLAGS)
flags.DEFINE_integer("cmi_ops", 10, "--run: scored memory operations per "
                     "rollout.", flag_values=FLAGS)
flags.DEFINE_string("chip", "", f"Roofline and fit against this chip "
                    f"({sorted(CHIPS)}, or `host`: this machine, measured) "
                    "instead of the topology's; e.g. --topology=v5p-16 "
                    "--chip=h20: 8 devices priced as 8 H20s.",
                    flag_values=FLAGS)


def main(argv: list[str]) -> list[dict]:
  del argv
  # The flags' values; `config` the file's name, which the lines name (the
  # config itself is loaded by its flag).
  args = types.SimpleNamespace(**{
      name: value for name, value in FLAGS.flag_values_dict().items()
      if "." not in name})
  args.config = config_flags.get_config_filename(FLAGS["config"])
  # Compiling touches no TPU: several planners (or a test run beside one)
  # may load libtpu at once instead of waiting on its lockfile.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  if args.topology.startswith("cpu:"):
    count = int(args.topology[4:])
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
      os.environ["XLA_FLAGS"] = (
          f"{flags} --xla_force_host_platform_device_count={count}")
  import jax
  from jax.sharding import Mesh

  from cmimem_jax import storage
  from cmimem_jax.models.attention import resolve_impl
  from cmimem_jax.parallel.mesh import AXES, parse_mesh_shape
  from cmimem_jax.rl.trainer import step_compiler_options

  devices, chip = _devices(args.topology)
  shape = parse_mesh_shape(args.mesh or f"fsdp:{len(devices)}")
  if math.prod(shape.values()) != len(devices):
    raise SystemExit(f"--mesh {shape} does not use the {len(devices)} "
                     f"devices of {args.topology}")
  mesh = Mesh(np.array(devices).reshape([shape[a] for a in AXES]), AXES)
  config = FLAGS.config
  if args.chip == "host":
    chip = host_chip(config.policy.dtype)
  elif args.chip:
    if args.chip not in CHIPS:
      raise SystemExit(f"--chip must be one of {sorted(CHIPS)} or host, got "
                       f"{args.chip!r}")
    chip = CHIPS[args.chip]
  if args.checkpoint and args.preset:
    raise SystemExit("--checkpoint and --preset both name the architecture: "
                     "give one")
  if args.checkpoint and not storage.path(
      storage.join(args.checkpoint, "config.json")).exists():
    raise SystemExit(f"--checkpoint={args.checkpoint}: no config.json there "
                     "(an HF checkpoint directory)")
  names = ([*RUN_PROGRAMS, *(["encoder"] if config.encoder.kind
                              == "qwen3_embedding" else [])] if args.run
           else [p for p in args.programs.split(",") if p])
  unknown = set(names) - set(PROGRAMS)
  if unknown:
    raise SystemExit(f"unknown programs {sorted(unknown)}; known: "
                     f"{sorted(PROGRAMS)}")
  rollout = config.rollout
  lengths = ([int(x) for x in args.length.split(",")] if args.length else
             [rollout.max_prompt_tokens + rollout.max_new_tokens])
  budgets = ([float(x) for x in args.budgets.split(",")] if args.budgets
             else [chip.hbm_gib] if chip else [16.0, 32.0, 95.0])
  if args.run and (chip is None or len(lengths) != 1):
    raise SystemExit("--run needs a chip's peak figures (a TPU topology "
                     "or --chip) and one --length")
  seconds: dict[str, float] = {}
  rows = []
  train_prompt_group = 1
  cmi_shape = tuple(int(x) for x in args.cmi_shape.split(","))
  for length in lengths:
    completion = args.completion or min(rollout.max_new_tokens, length // 4)
    step, model_config, notes = trainer_step(
        config, mesh, args.preset, args.checkpoint, args.layers, completion)
    group = step.settings.group
    # Forward + backward (x2), the remat re-forward, the reference forward.
    passes = (3 + (model_config.remat != "none")
              + step.learner.config.loss.uses_reference)
    encoder = (plan_encoder(config.encoder, mesh, args.layers)
               if "encoder" in names else None)
    if args.run:
      layout = run_layout(config, len(devices), step.engine.row_shards)
      batches = {name: [layout.get(name, 1)] for name in names}
    else:
      batches = {name: [int(b) for b in args.batch.split(",")]
                 for name in names}
    if encoder is not None:  # Its own batch and length: its largest call.
      batches["encoder"] = [encoder.batch_size]
    for name in names:
      points = []
      # The encoder's own architecture and rows; the others the policy's.
      costed, tokens = ((encoder.model.config, encoder.max_length)
                        if name == "encoder" else (model_config, length))
      for rows_per_chip in batches[name]:
        start = time.perf_counter()
        # Rows per shared prompt of the update (`rl.share_prompts`).
        prompt_group = (step.update_prompt_group(
            rows_per_chip * step.learner.shards
            * step.learner.config.micro_batches) if name == "train" else 1)
        if name == "train":
          train_prompt_group = prompt_group
        # The mesh in context: the splash kernel shards itself over it, and
        # "auto" attention resolves for its platform (the encoder: its one
        # device, as the trainer runs it).
        with jax.set_mesh(first_device(mesh) if name == "encoder" else mesh):
          cost, parts = program_cost(costed, name, rows_per_chip, tokens,
                                     completion, passes, group, cmi_shape,
                                     prompt_group)
          if chip is not None:
            seconds.update({part: roofline(c, chip)[0]
                            for part, c in parts.items()})
          lowered = lower_program(step, name, rows_per_chip, length,
                                  completion, cmi_shape, encoder)
          impl = resolve_impl(costed.attention_impl,
                              length - completion if name == "rollout"
                              else tokens, costed.compute_dtype)
          try:
            measured = measure(lowered.compile(
                step_compiler_options(mesh) if name == "train" else None),
                chip, cost, resident_bytes(step, name))
          except jax.errors.JaxRuntimeError as e:
            # The TPU compiler refuses a program over its HBM.
            if "RESOURCE_EXHAUSTED" not in str(e):
              raise
            measured = {"fits": False, "error": str(e).splitlines()[0][:300]}
        model_fields = ({"cmi_shape": list(cmi_shape)}
                        if name == "cmi_kernel" else
                        {"layers": costed.num_hidden_layers,
                         "attention_impl": impl})
        decoding = ({"rollouts_per_prompt": group,
                     "decode_devices": step.engine.decode_devices,
                     "decoding_chips": step.engine.row_shards,
                     **{f"{part}_roofline_s": round(roofline(c, chip)[0], 6)
                        for part, c in parts.items()
                        if chip is not None}}
                    if name == "rollout" else {})
        global_batch = rows_per_chip * (
            step.engine.row_shards if name == "rollout" else
            step.learner.shards * step.learner.config.micro_batches
            if name == "train" else 1 if name == "encoder"
            else len(devices))
        row = {"program": name, "topology": args.topology,
               "device_kind": devices[0].device_kind,
               "devices": len(devices), "mesh": dict(mesh.shape),
               **model_fields, "rows_per_chip": rows_per_chip, **decoding,
               **({"micro_batches": step.learner.config.micro_batches,
                   "prompt_group": prompt_group}
                  if name == "train" else {}),
               "global_batch": global_batch,
               **({} if name == "cmi_kernel" else {"length": tokens}
                  if name == "encoder" else
                  {"length": length, "completion": completion}),
               **measured, **({"stand_ins": notes} if name in (
                   "train", "rollout") else {}),
               "compile_s": round(time.perf_counter() - start, 1)}
        if "total_gib" in row:
          points.append((rows_per_chip, row["total_gib"]))
          if chip is None:
            row["host_gib"] = round(
                row["total_gib"] * len(devices) + HOST_RUNTIME_GIB, 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
      if len(points) >= 2:
        rows.append(_fit(name, length, points, budgets))
        print(json.dumps(rows[-1]), flush=True)
  if args.run:
    for run in _run(args, config, model_config, chip, layout, seconds,
                    [r for r in rows if "program" in r and "topology" in r],
                    passes, lengths[0], completion, train_prompt_group):
      rows.append(run)
      print(json.dumps(run), flush=True)
      print(run_table(run), file=sys.stderr, flush=True)
  if args.markdown:
    print(to_markdown(rows))
  return rows


MARKDOWN_COLUMNS = (
    ("topology", "topology"), ("program", "program"),
    ("rows_per_chip", "rows (prompts) / chip"), ("length", "tokens"),
    ("arguments_gib", "arguments GiB"), ("temporaries_gib", "temporaries GiB"),
    ("outputs_gib", "outputs GiB"), ("aliased_gib", "aliased GiB"),
    ("total_gib", "total GiB"), ("hbm_gib", "HBM GiB"), ("fits", "fits"),
    ("model_tflops", "TFLOP / chip"), ("model_bytes_gib", "HBM traffic GiB"),
    ("roofline_s", "roofline s"), ("bound", "bound"),
    ("compile_s", "compile s"))


def to_markdown(rows: list[dict]) -> str:
  """The compiled programs (not the fit summaries) as a Markdown table."""
  lines = ["| " + " | ".join(title for _, title in MARKDOWN_COLUMNS) + " |",
           "|" + "---|" * len(MARKDOWN_COLUMNS)]
  for row in rows:
    if "topology" in row:
      lines.append("| " + " | ".join(
          str(row.get(key, "—")).lower() if key == "fits" else
          str(row.get(key, "—")) for key, _ in MARKDOWN_COLUMNS) + " |")
  return "\n".join(lines)


def _fit(name: str, length: int, points: list[tuple[int, float]],
         budgets: list[float]) -> dict:
  """Memory is affine in the rows per chip (weights + optimizer state + per
  row activations / cache): the most rows that fit each budget."""
  (b0, m0), (b1, m1) = points[0], points[-1]
  per_row = (m1 - m0) / (b1 - b0)
  fixed = m0 - per_row * b0
  fits = {f"{budget:g}GiB": (max(0, int((budget - fixed) // per_row))
                             if per_row > 0 else None) for budget in budgets}
  return {"program": name, "length": length, "fixed_gib": round(fixed, 3),
          "per_row_gib": round(per_row, 3), "max_rows_per_chip": fits}


if __name__ == "__main__":
  # Its compile times are measured: never loaded from a cache.
  run_command(main, workdir=False, flag_values=FLAGS,
              compilation_cache=False)
