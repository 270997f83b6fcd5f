"""A laptop-CPU reproduction of the whole recipe, one command: warm start
-> GRPO with the CMI+QA reward, the QA reward alone and the CMI reward
alone, from the same warm start with the same budget, in two seeds ->
evaluation of the initial, warm-started and RL policies on LoCoMo
conversations no training step saw, with a report of paired differences
(95 % bootstrap intervals) pooled over the seeds.

  python -m tools.reproduce --config=configs/small_repro.py --workdir=DIR

A rerun resumes (finished stages are skipped). Where each stage runs:
`tools/reproduce.py`'s docstring; what its runs measured, and how long
they took: RESULTS.md.

Models: SmolLM2-135M-Instruct (embedded GGUF) + all-MiniLM-L6-v2, every
response grammar-constrained to valid DSL. Split (LoCoMo `locomo10.json`,
10 conversations in file order):
- warm start: the annotation teacher (observations / event summaries as
  DSL) on conversations 0-7 (`repro.teacher_dialogues`); 16 steps of 2
  trajectories, those with prompts up to 2,048 tokens and responses up to
  512 (the early sessions). `sft.trim_retrieved` (trimming the retrieved
  entries until a prompt fits) is off: decided on a validation
  conversation before any held-out score was read
  (results/warm_start_trim_choice/, RESULTS.md);
- GRPO, every arm: the bundled LongMemEval training sample (per-session
  QA, the demo's data: LoCoMo has no single-session QA pairs to reward),
  at `rl.learning_rate`, seed `seed` in DIR and each of
  `repro.other_seeds` in DIR/seed<s>;
- evaluation: conversations 8-9 (conv-49, conv-50), `method=policy`,
  `context_recall`, evidence-turn recall (`repro.eval_dialogues`), at the
  paper's LookupChunk budget and at `repro.equal_budget_chars`.

The GRPO learning rate chosen on the validation curve (round five's
sweep, RESULTS.md): `repro.other_learning_rates` runs every arm at those
rates too (DIR/lr<rate>) and evaluates each arm from the rate its
validation reward picks, never from the evaluation dialogues:

  python -m tools.reproduce --config=configs/small_repro.py --workdir=DIR \
      --config.repro.other_learning_rates="(3e-6,3e-5)"

`python -m cmimem_jax.sft` and `python -m cmimem_jax.train` also accept
this file on their own (set `--config.sft.data` for the former).
"""

import ml_collections

from configs import default, eval_cpu


def get_config() -> ml_collections.ConfigDict:
  config = default.get_config()
  # Short rows keep a step ~1 minute: prompts of the first 8 LoCoMo
  # conversations are 0.9-3.6k tokens (half of it the retrieved entries),
  # annotation responses 0.1-0.6k.
  config.sft = ml_collections.ConfigDict({
      "data": "", "batch_size": 2, "micro_batches": 1, "epochs": 1,
      "max_steps": 16, "learning_rate": 5e-5, "warmup_steps": 2,
      "weight_decay": 0.0, "grad_clip_norm": 1.0,
      "max_prompt_tokens": 2048, "max_response_tokens": 512,
      "trim_retrieved": False,
      "buckets": (1024, 1536, 2048), "logprob_chunk": 128})
  # Groups of 4 rollouts (GRPO's advantages need spread within a group);
  # 10 steps of 3 sessions per arm. Two held-out training sessions are
  # answered greedily every 2 steps: the validation curve
  # (validation.png), on which each arm's evaluated checkpoint is chosen
  # (every 2nd step is kept for that), never on the evaluation dialogues.
  # Every rollout goes to rollouts.jsonl (tools/skip_report.py reads it).
  config.rollout.num_rollouts = 4
  # r_QA during GRPO reads the retrieved memories alone (no LookupChunk;
  # the evaluation below keeps it). With LookupChunk any entry written
  # from the session brings back the session's turns, so the CPU proxy
  # (`context_recall`) scores every rollout of a group alike (RESULTS.md,
  # round two). Without it, r_QA is 1 only where the written memories
  # carry the answer.
  config.memory.source_chunks = False
  config.rl.update({"max_steps": 10, "validation_sessions": 2,
                    "eval_every": 2, "log_rollouts": True})
  config.checkpoint.update({"keep": 1, "keep_period": 2})
  # equal_budget_chars: the LookupChunk budget every policy's banks are
  # evaluated at again (`eval_equal_budget`), besides the paper's 160,000:
  # about three LoCoMo sessions of source turns (fixed before any
  # evaluation at it was read).
  # other_seeds: GRPO seeds besides `seed`, each from the same warm start
  # (Table 3's arms need more than one to say anything).
  # other_learning_rates: GRPO rates besides `rl.learning_rate`; with any,
  # each arm is evaluated from the rate its validation curve picks.
  config.repro = ml_collections.ConfigDict({
      "locomo": "../shared/data/locomo/locomo10.json",
      "teacher_dialogues": "0:8", "eval_dialogues": "8:10",
      "equal_budget_chars": 8000, "other_seeds": (1,),
      "other_learning_rates": ()})
  # The evaluation job's sections (`cmimem_jax.evaluate`), local builder.
  evaluation = eval_cpu.get_config()
  config.evaluation = evaluation
  evaluation.encoder = config.encoder
  evaluation.method = "policy"
  evaluation.judge.kind = "context_recall"
  evaluation.builder.update({"kind": "local", "constrained_dsl": True,
                             "max_new_tokens": 192})
  return config
