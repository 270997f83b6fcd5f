"""The CPU configs bound the learner's LM-head scratch (issue 44)."""

import pytest

import configs.default
import configs.small_repro

# SmolLM2-135M's vocabulary (the embedded GGUF both configs train).
VOCAB = 49152
# One `[rows, chunk, V]` f32 array; the step keeps 4-5 of them alive.
BUDGET_BYTES = 64 << 20


@pytest.mark.parametrize("module", [configs.default, configs.small_repro])
def test_one_logprob_chunk_stays_under_the_budget(module):
  config = module.get_config()
  rows = (config.rl.sessions_per_batch * config.rollout.num_rollouts
          // config.rl.micro_batches)
  columns = min(config.rl.logprob_chunk, config.rollout.max_new_tokens)
  assert rows * columns * VOCAB * 4 <= BUDGET_BYTES, (
      f"rl.logprob_chunk={config.rl.logprob_chunk}: {rows} rows x "
      f"{columns} columns of logits exceed {BUDGET_BYTES >> 20} MiB")
