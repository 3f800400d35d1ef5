# The two commands of the README. Both create .venv and install megalite on first use.
#   make train   train the tiny GPT on the builtin corpus (CPU, a few minutes), then sample
#                (CONFIG=configs/llama-tiny.yaml for the Llama, ARGS="train.steps=20" for overrides)
#   make test    run the test suite
# CUDA users: make train TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
CONFIG ?= configs/gpt-tiny.yaml
ARGS ?=
TEST_WORKERS ?= 2
RUN_DIR ?= runs/$(basename $(notdir $(CONFIG)))-$(shell date +%Y%m%d-%H%M%S)
BIN := $(VENV)/bin
STAMP := $(VENV)/.megalite-installed

.PHONY: setup train test lint

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_SPEC)
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $(STAMP)

setup: $(STAMP)

train: setup
	$(BIN)/megalite train --config $(CONFIG) train.out_dir=$(RUN_DIR) $(ARGS)
	$(BIN)/megalite generate --checkpoint $(RUN_DIR) \
		--prompt "And God said" --max-new-tokens 60 --temperature 0.8 --top-k 40

# The suite runs on TEST_WORKERS processes (pytest-xdist); the tests that assert on wall-clock time
# (marked serial: time-outs, delays, overlap) run after them, alone, so no other test's load can
# make them late.
test: setup
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) -m "not serial" tests
	$(BIN)/python -m pytest -q -m serial tests

lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check .
