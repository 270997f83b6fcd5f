"""A laptop-CPU reproduction of the whole recipe (about an hour on 2
cores): warm start -> GRPO -> evaluation of the initial, warm-started and
RL policies on LoCoMo conversations no training step saw.

  python tools/reproduce.py --config=configs/small_repro.py --workdir=DIR

Models: SmolLM2-135M-Instruct (embedded GGUF) + all-MiniLM-L6-v2, every
response grammar-constrained to valid DSL. Split (LoCoMo `locomo10.json`,
10 conversations in file order):
- warm start: the annotation teacher (observations / event summaries as
  DSL) on conversations 0-7 (`repro.teacher_dialogues`);
- GRPO: the bundled LongMemEval training sample (per-session QA, the
  demo's data: LoCoMo has no single-session QA pairs to reward);
- evaluation: conversations 8-9 (conv-49, conv-50), `method=policy`,
  `context_recall`, evidence-turn recall (`repro.eval_dialogues`).

`python -m cmimem_jax.sft` and `python -m cmimem_jax.train` also accept
this file on their own (set `--config.sft.data` for the former).
"""

import ml_collections

from configs import default, eval_cpu


def get_config() -> ml_collections.ConfigDict:
  config = default.get_config()
  # Short rows keep a step ~1 minute: prompts of the first 8 LoCoMo
  # conversations are 0.9-3.1k tokens, annotation responses 0.1-0.5k.
  config.sft = ml_collections.ConfigDict({
      "data": "", "batch_size": 2, "micro_batches": 1, "epochs": 1,
      "max_steps": 16, "learning_rate": 5e-5, "warmup_steps": 2,
      "weight_decay": 0.0, "grad_clip_norm": 1.0,
      "max_prompt_tokens": 2048, "max_response_tokens": 384,
      "buckets": (1024, 1536, 2048), "logprob_chunk": 128})
  # Two held-out training sessions scored every 2 steps: the validation
  # curve (validation.png) that picks a checkpoint or learning rate.
  config.rl.update({"max_steps": 6, "validation_sessions": 2,
                    "eval_every": 2})
  config.repro = ml_collections.ConfigDict({
      "locomo": "../shared/data/locomo/locomo10.json",
      "teacher_dialogues": "0:8", "eval_dialogues": "8:10"})
  # The evaluation job's sections (`cmimem_jax.evaluate`), local builder.
  evaluation = eval_cpu.get_config()
  config.evaluation = evaluation
  evaluation.encoder = config.encoder
  evaluation.method = "policy"
  evaluation.judge.kind = "context_recall"
  evaluation.builder.update({"kind": "local", "constrained_dsl": True,
                             "max_new_tokens": 192})
  return config
