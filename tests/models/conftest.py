"""The model tests compare against `transformers` (random checkpoints from
`cmimem_jax.testing.hf_models`): skipped where torch or transformers is
missing."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
