"""Command-line tools over the library: benchmarks, the ahead-of-time
plan, the small reproduction, data preparation, the rehearsal. Each runs
from the repository root as `python -m tools.NAME` (absl flags in its own
`FLAGS`, through `cmimem_jax.config.run_command`), imports the library
and `configs`, never another tool (`tests/test_layers.py`)."""
