"""One config per ablation row of the paper's Tables 3 and 9, each a base
config plus the few fields in its `CHANGES` (`BASE`: the module whose
`get_config` it starts from).

Trained rows start from the 4B training config (`configs/qwen3_4b_tpu.py`);
the same rows on the H20 / vLLM setup: `--config=configs/qwen3_4b_h20_vllm.py`
with the row's `CHANGES` as `--config.KEY=VALUE` flags.

Rows without GRPO ("Qwen3-4B" and "+RM": the base policy prompted, whose
numbers are Table 1's MemBuilder-P and Ours-P) are evaluations of the
prompting pipeline (the four JSON agents) from `configs/eval_qwen3_4b.py`:
`python -m cmimem_jax.evaluate --config=configs/ablations/table3_rm.py`.
"""

from collections.abc import Mapping
from types import ModuleType

import ml_collections

from cmimem_jax.config import apply_overrides

# Flat memory: no source turns for the answer model (Table 3 without "RM").
FLAT_MEMORY = {"memory.source_chunks": False}
# The base model prompted with the four JSON agents (no GRPO).
PROMPTING = {"method": "prompting"}


def derive(changes: Mapping[str, object], base: ModuleType
           ) -> ml_collections.ConfigDict:
  """`base.get_config()` with `changes` (dotted keys) applied."""
  return apply_overrides(base.get_config(), dict(changes))
