"""The paper's evaluation (§4, Alg. 2, Tables 1 / 3 / 9) of a Qwen3-4B
memory builder on LongMemEval's 400-question test split.

Builder: Qwen3-4B-Instruct-2507 with a trained policy's weights
(`builder.init_checkpoint` = a `cmimem_jax.train` workdir,
`builder.checkpoint_step` = the step App. I selects: 20 for CMI+QA, 50
for QA only), DSL responses of up to 6,000 tokens (Table 7; a response cut
short is invalid and its session is lost), the policy compressing its own
core (Listing 5) and writing MERGE summaries (Listing 9). Retrieval:
Qwen3-Embedding-0.6B with the 4B configs' query instruction, top-10
fragments over all types plus LookupChunk source turns (Table 6). Answers
and judgements: an LLM through OpenAI-compatible endpoints (the paper:
Qwen3.7-Max for both), Listing 10 / Listing 11.

  python -m cmimem_jax.evaluate --config=configs/eval_qwen3_4b.py --workdir=DIR \
      --config.dataset.path=/data/longmemeval_s_cleaned.json \
      --config.encoder.path=/ckpt/Qwen3-Embedding-0.6B \
      --config.builder.path=/ckpt/Qwen3-4B-Instruct-2507 \
      --config.builder.init_checkpoint=/runs/cmi_qa --config.builder.checkpoint_step=20 \
      --config.answer.endpoint.base_url=URL --config.judge.endpoint.base_url=URL

The builder may instead be served (e.g. vLLM with the trained weights
saved by `save_hf`): `--config.builder.kind=endpoint` (its `max_tokens`
is 6,000 too). Table 3's prompting rows ("Qwen3-4B", "+RM") are this
config with `method=prompting` (`configs/ablations/`).
"""

import ml_collections

from configs import eval_cpu, qwen3_4b

# Table 7: responses up to 6,000 tokens.
RESPONSE_TOKENS = 6000
# The paper's shared answer model and judge (§4.1).
ANSWER_MODEL = "Qwen3.7-Max"


def get_config() -> ml_collections.ConfigDict:
  config = eval_cpu.get_config()
  training = qwen3_4b.get_config()
  config.dataset.update({"name": "longmemeval", "path": "", "split": "test"})
  config.encoder = training.encoder  # Qwen3-Embedding, one instruction.
  config.memory = training.memory    # Top-k 10, LookupChunk, editors.
  config.method = "policy"
  config.builder.update({"kind": "local", "path": "",
                         "max_new_tokens": RESPONSE_TOKENS,
                         "constrained_dsl": False})
  config.builder.endpoint.max_tokens = RESPONSE_TOKENS
  hosted = {"model": ANSWER_MODEL, "timeout_s": 120.0, "max_tokens": 512,
            "concurrency": 16}
  config.answer.kind = "endpoint"
  config.answer.endpoint.update(hosted)
  config.judge.update({"kind": "llm", "prompt": "listing11"})
  config.judge.endpoint.update(hosted)
  return config
