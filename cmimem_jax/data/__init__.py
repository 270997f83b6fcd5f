"""Benchmark loaders mapping LongMemEval, LoCoMo and MemoryAgentBench to
`Dialogue`s, and the safe file handling of what the jobs write (`files`)."""

from cmimem_jax.data.files import (WorkdirBusy, WorkdirLock, path_under,
                                    read_jsonl, rewrite_jsonl, safe_name)
from cmimem_jax.data.locomo import LOCOMO_CATEGORIES, load_locomo
from cmimem_jax.data.longmemeval import LONGMEMEVAL_TYPES, load_longmemeval
from cmimem_jax.data.memoryagentbench import chunk_text, load_memoryagentbench
from cmimem_jax.data.registry import (LOADERS, LONGMEMEVAL_SPLITS,
                                      DatasetConfig, bundled_path,
                                      configured_split, load_configured,
                                      load_dataset, longmemeval_split_ids)
from cmimem_jax.data.schema import parse_date
from cmimem_jax.data.types import (NOT_ANSWERABLE, DatasetError, Dialogue,
                                   Question, Session, Turn)

__all__ = [
    "DatasetConfig", "DatasetError", "Dialogue", "LOADERS",
    "LONGMEMEVAL_SPLITS",
    "NOT_ANSWERABLE", "configured_split", "load_configured",
    "longmemeval_split_ids", "LOCOMO_CATEGORIES", "LONGMEMEVAL_TYPES",
    "Question", "Session", "Turn", "WorkdirBusy", "WorkdirLock",
    "bundled_path", "chunk_text", "load_locomo",
    "load_dataset", "load_longmemeval", "load_memoryagentbench", "parse_date",
    "path_under", "read_jsonl", "rewrite_jsonl", "safe_name",
]

