"""Hugging Face tokenizers without `transformers`' model machinery.

`AutoTokenizer` resolves the tokenizer class through `AutoConfig`, whose
module imports torch: 3 s and ~0.2 GiB of resident memory in every train,
serve, sft and evaluate process, which never run a torch model. A
directory with a `tokenizer.json` (every fast tokenizer: Qwen3, SmolLM2,
BERT) is read by `PreTrainedTokenizerFast` directly: the same Rust
tokenizer, special tokens and chat template from `tokenizer_config.json`,
so the same ids (tests/models/test_hf_tokenizer.py). Directories with only
a slow tokenizer's files (`tokenizer.model`, `vocab.json`) still go
through `AutoTokenizer`.
"""

from __future__ import annotations

import os
from typing import Any

FAST_TOKENIZER_FILE = "tokenizer.json"


def load_hf_tokenizer(directory: str, **kwargs: Any) -> Any:
  """The tokenizer saved in an HF directory; `kwargs` as `from_pretrained`'s
  (e.g. `padding_side="left"`)."""
  if os.path.isfile(os.path.join(directory, FAST_TOKENIZER_FILE)):
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast.from_pretrained(directory, **kwargs)
  from transformers import AutoTokenizer
  return AutoTokenizer.from_pretrained(directory, **kwargs)
