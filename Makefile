# The two commands a newcomer needs:
#   make run   - install into .venv and run every service (mock GPUs when there is no GPU)
#   make test  - install into .venv and run lint, type checks and the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test install lint typecheck pytest bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# Real NVML when nvidia-smi sees a GPU, otherwise the mock 8x H100 node.
run: $(STAMP)
	@if nvidia-smi -L >/dev/null 2>&1; then nvml=nvml; else nvml=mock; \
	  echo "no NVIDIA GPU found: running against the mock NVML (scenario dgx-h100)"; fi; \
	exec $(BIN)/gpulet run --nvml $$nvml --state-dir .gpulet $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP)
	$(BIN)/pytest -q $(PYTEST_ARGS)

test: lint typecheck pytest

bench: $(STAMP)
	$(BIN)/python bench/run_all.py

clean:
	rm -rf $(VENV) .gpulet .mypy_cache .ruff_cache
