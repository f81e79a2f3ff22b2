# lakeshard: `make run` (set up, then a local cluster answers a chat) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROMPT ?= Explain in two sentences why splitting a language model across several laptops helps.

.PHONY: setup run test test-fast lint bench-parity clean

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -c constraints.txt -e '.[dev,gui]'
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(BIN)/lakeshard models pull smollm2-135m
	$(BIN)/lakeshard demo --model smollm2-135m --nodes 2 --prompt "$(PROMPT)"

test: setup
	$(BIN)/ruff check agent coordinator gui tests
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/python -m pytest

# the unit layer only (tests/unit: pure functions and in-process parts, seconds)
test-fast: setup
	$(BIN)/python -m pytest -m "not slow"

lint: setup
	$(BIN)/ruff check agent coordinator gui tests
	$(BIN)/ruff format --check agent coordinator gui tests
	$(BIN)/mypy
	$(BIN)/lint-imports

bench-parity: setup
	$(BIN)/lakeshard bench parity --model qwen2.5-coder-0.5b --weights int4 --json

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache .mypy_cache
