# Two commands that work on a fresh machine with Python 3.11+ and pip:
#   make demo   set up, then train the main job (a small Shakespeare language model, ~8 min on 2 CPU cores)
#   make test   set up, then lint, format-check and run the test suite
# and `make docs`: the documentation site into site/ (guides, and the API reference from docstrings).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# jemalloc for the test processes and every process they start, where the system has it (Debian and
# Ubuntu: `apt install libjemalloc2`; .ci/run installs it): the suite's time is XLA compiling thousands of
# small programs and JAX tracing them, and glibc's malloc and free took ~15% of the CPU time of a process
# that traces and compiles a tiny model's gradient. With jemalloc the same tests take 10-14% less CPU time
# (tests/test_models.py and test_moe.py, run side by side with and without it). Without the library, glibc's.
JEMALLOC ?= $(firstword $(wildcard /usr/lib/*/libjemalloc.so.2 /usr/lib64/libjemalloc.so.2 /usr/local/lib/libjemalloc.so.2))

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
	LD_PRELOAD="$(strip $(JEMALLOC) $(LD_PRELOAD))" $(BIN)/pytest -n 2 --dist loadfile --no-loadscope-reorder -q --durations=20  # heaviest files first: tests/conftest.py

# The documentation site into site/: the generated pages (config, CLI) rewritten from the code, then a
# strict build (any warning fails, as in CI). NO_MKDOCS_2_WARNING: Material's end-of-life banner (mkdocs.yml).
$(VENV)/.docs: pyproject.toml | $(BIN)/jaxformer
	$(BIN)/pip install --quiet -e ".[docs]"
	touch $@

docs: setup $(VENV)/.docs
	$(BIN)/python scripts/make_reference_pages.py
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict
	@echo "docs: open file://$(CURDIR)/site/index.html (or serve with live reload: $(BIN)/mkdocs serve)"

# tests/test_gpu.py with XLA's GPU compiler (deviceless H100s), in a virtualenv of its own (.venv-gpu-plan):
# the CUDA plugin's driver notices on a machine without a GPU stay out of the main suite's output.
test-gpu-plan:
	$(PYTHON) -m venv .venv-gpu-plan
	.venv-gpu-plan/bin/pip install --quiet --upgrade pip
	.venv-gpu-plan/bin/pip install --quiet -e ".[test,gpu-plan]"
	.venv-gpu-plan/bin/python -c "import jax_cuda12_plugin"  # installed: the tests must not skip
	.venv-gpu-plan/bin/pytest -q -p no:cacheprovider tests/test_gpu.py

gpu-check: setup  # on a machine with an NVIDIA GPU and a CUDA build of jax (see scripts/gpu_check.sh)
	PYTHON=$(BIN)/python bash scripts/gpu_check.sh

.PHONY: setup demo test test-gpu-plan docs gpu-check
