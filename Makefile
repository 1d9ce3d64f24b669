# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: demo test test-slow lint install clean

# uv (pinned in constraints.txt like everything else) installs the pinned set: about 30 s here
# where pip took 3.5 minutes. It reads no pip config, so it is given pip's find-links (this
# machine's local wheels, e.g. the CPU build of torch) when they are set in the environment.
ifdef PIP_FIND_LINKS
export UV_FIND_LINKS ?= $(PIP_FIND_LINKS)
endif
NEW_VENV = test -x $(BIN)/uv || { { $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV); } && \
	$(BIN)/python -m pip install -qq -c constraints.txt uv; }
UV_INSTALL = $(BIN)/uv pip install -q --python $(BIN)/python -c constraints.txt

$(STAMP): setup.py constraints.txt
	$(NEW_VENV)
	$(UV_INSTALL) -e .
	touch $(STAMP)

# Tests also need pytest, scipy, torch (import-torch), libtpu (TPU ahead-of-time compiles),
# lm_eval (the harness model), the server and openai (its client), wandb (its writer, tested
# offline) and the linters: one install of the package with those extras, which is also the
# plain install.
$(TEST_STAMP): setup.py constraints.txt
	$(NEW_VENV)
	$(UV_INSTALL) -e ".[test,tpu,harness,serve,wandb,lint]"
	touch $(STAMP) $(TEST_STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/ao-mdm train --config=configs/demo.py --workdir=runs/demo
	$(BIN)/ao-mdm sample --checkpoint=runs/demo --num_samples=1 --steps=32 --top_p=0.9 --seed=1
	$(BIN)/ao-mdm sample --checkpoint=runs/demo --num_samples=1 --steps=32 --top_p=0.9 --seed=2 \
	  --prompt="Fellow citizens of the Senate and House of Representatives:"
	$(BIN)/ao-mdm sample --checkpoint=runs/demo --num_samples=1 --steps=8 --top_p=0.9 --seed=3 \
	  --infill="Another important acquisition of [MASK] has also been made since the last [MASK] of Congress."
	$(BIN)/ao-mdm sample --checkpoint=runs/demo --num_samples=1 --mode=speculative --draft=4 --seed=4 \
	  --prompt="Fellow citizens of the Senate and House of Representatives:"

# The default stage: tests/unit and tests/integration but the tests marked slow, test files on
# TEST_JOBS processes (pytest-xdist, whole files per process). Every process of both stages
# compiles into one XLA cache kept in .venv (tests/conftest.py takes JAX_COMPILATION_CACHE_DIR),
# so the slow stage loads what the default stage compiled.
TEST_JOBS ?= 2
PYTEST := JAX_COMPILATION_CACHE_DIR=$(CURDIR)/$(VENV)/xla-cache-tests $(BIN)/python -m pytest -q
test: $(TEST_STAMP)
	$(PYTEST) -n $(TEST_JOBS) --dist loadfile

# ruff (lint, then format: a file that would change fails) and mypy over ao_mdm/.
lint: $(TEST_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The slow stage (CI runs it after `make test`): the tests marked slow on TEST_JOBS processes
# (whole files per process), then those also marked `alone` one at a time: they time a bounded
# detection, signal a process after a delay, or run processes that watch each other's
# heartbeats, and beside another test they starve.
test-slow: $(TEST_STAMP)
	$(PYTEST) -m "slow and not alone" -n $(TEST_JOBS) --dist loadfile --durations=15
	$(PYTEST) -m "slow and alone" --durations=15 tests/integration

clean:
	rm -rf $(VENV) runs
