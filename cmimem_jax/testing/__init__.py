"""Stand-ins for what a CPU machine lacks, shared by the test suite and
`tools/rehearse.py`: random-weight checkpoints shaped like the paper's
(`standins`), random tiny `transformers` causal LMs the model tests
compare against (`hf_models`), a scripted OpenAI-compatible LLM that
answers each documented prompt in its format (`scripted_llm`), a
loopback OpenAI server with injected failures (`fake_openai`), a Google
Cloud Storage emulator (`gcs_emulator`); and `run_tool`, a tool's
command line run in this process. The servers run on their own as
`python -m cmimem_jax.testing.NAME`.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any

from cmimem_jax.config import run_in_process


def run_tool(tool: types.ModuleType, argv: Sequence[str]) -> Any:
  """What `python -m tools.NAME ARGV...` runs, in this process: the tool's
  flags (`tool.FLAGS`) parsed afresh from `argv` (flags and positional
  arguments, no program name), then its `main`, a user's mistake one line
  on stderr and a `SystemExit` as on the command line; returns what
  `main` returns."""
  return run_in_process(tool.main, tool.FLAGS, argv, program=tool.__name__)
