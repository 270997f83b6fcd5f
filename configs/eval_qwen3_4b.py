"""The paper's evaluation (§4, Alg. 2, Tables 1 / 3 / 9) of a Qwen3-4B
memory builder on LongMemEval's 400-question test split:
`configs/paper.py`'s `evaluation()` as it stands.

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

  python -m cmimem_jax.evaluate --config=configs/eval_qwen3_4b.py --workdir=DIR \\
      --config.dataset.path=/data/longmemeval_s_cleaned.json \\
      --config.encoder.path=/ckpt/Qwen3-Embedding-0.6B \\
      --config.builder.path=/ckpt/Qwen3-4B-Instruct-2507 \\
      --config.builder.init_checkpoint=/runs/cmi_qa --config.builder.checkpoint_step=20 \\
      --config.answer.endpoint.base_url=URL --config.judge.endpoint.base_url=URL

The builder may instead be served (e.g. vLLM with the trained weights
saved by `save_hf`): `--config.builder.kind=endpoint` (its `max_tokens`
is 6,000 too). Table 3's prompting rows ("Qwen3-4B", "+RM") are this
config with `method=prompting` (`configs/ablations/`).
"""

import ml_collections

from configs import paper


def get_config() -> ml_collections.ConfigDict:
  return paper.evaluation()
