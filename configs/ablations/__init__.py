"""One config per ablation row of the paper's Tables 3 and 9, each the base
4B config (`configs/qwen3_4b_tpu.py`) plus the few fields in its `CHANGES`.

The same rows on the H20 / vLLM setup: `--config=configs/qwen3_4b_h20_vllm.py`
with the row's `CHANGES` as `--config.KEY=VALUE` flags.

Rows without GRPO (`rl.epochs = 0`: "Qwen3-4B" and "+RM", prompting only)
train nothing; evaluate the base policy with `python -m cmimem_jax.evaluate
--config.method=policy` under the same memory settings.
"""

from collections.abc import Mapping

import ml_collections

from cmimem_jax.config import apply_overrides
from configs import qwen3_4b_tpu

# Flat memory: no source turns for the answer model (Table 3 without "RM").
FLAT_MEMORY = {"memory.source_chunks": False}
PROMPTING_ONLY = {"rl.epochs": 0}


def derive(changes: Mapping[str, object]) -> ml_collections.ConfigDict:
  """The base 4B config with `changes` (dotted keys) applied."""
  return apply_overrides(qwen3_4b_tpu.get_config(), dict(changes))
