# Two entry points for a newcomer on a fresh machine (README.md):
#   make demo   set up, then profile -> solve -> run -> validate the bundled example on CPU
#   make test   set up, then run the test suite (all of it, two pytest workers: about 45 minutes on 2 cores)
#   make test-fast   everything but the multi-process tests marked slow (a few minutes)
# Both create .venv with the CPU build of torch pinned (an unpinned torch pulls a CUDA build).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_PIN := torch==2.13.0

.PHONY: setup demo test test-fast lint typecheck clean

$(BIN)/planner: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_PIN)
	$(BIN)/pip install -q -e '.[test]'
	touch $@

setup: $(BIN)/planner

demo: setup
	$(BIN)/python examples/demo.py

# Two pytest workers (pytest-xdist; fewer on a 1-CPU machine): a multi-process test spends part
# of its time starting interpreters and waiting on its peers, which the other worker fills.
PYTEST_WORKERS := -n auto --maxprocesses 2

test: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q $(PYTEST_WORKERS)

lint: setup
	$(BIN)/ruff check planner runtime
	$(BIN)/mypy planner runtime

typecheck: setup
	$(BIN)/mypy planner runtime

test-fast: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q $(PYTEST_WORKERS) -m "not slow"

clean:
	rm -rf $(VENV) runs
