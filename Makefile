# Two commands that work on a fresh machine with Python 3.11+ and pip:
#   make demo   set up, then train the main job (a small Shakespeare language model, ~8 min on 2 CPU cores)
#   make test   set up, then lint, format-check and run the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

$(BIN)/jaxformer: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[test]"
	touch $@

setup: $(BIN)/jaxformer

demo: setup
	$(BIN)/jaxformer train --config experiments/lm_shakespeare.py --workdir runs/lm_shakespeare

test: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/pytest -n 2 --dist loadfile -q --durations=20

gpu-check: setup  # on a machine with an NVIDIA GPU and a CUDA build of jax (see scripts/gpu_check.sh)
	PYTHON=$(BIN)/python bash scripts/gpu_check.sh

.PHONY: setup demo test gpu-check
