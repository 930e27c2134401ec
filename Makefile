# The two commands a newcomer needs:
#   make run   - install the agent into .venv from uv.lock and run every service
#                (mock GPUs when there is no GPU)
#   make test  - install the agent and its test tools from uv.lock, then run lint, type
#                checks and the test suite (IMAGE_TESTS=1 make test adds the image tests,
#                as CI runs it)
# and for dependencies and containers:
#   make lock        - upgrade uv.lock (and requirements/all.txt) and show what changed
#   make test-latest - the suite on the newest versions pyproject.toml allows, not the lock
#   make image       - the gpulet image and its NATS sidecar image (podman or docker)
#
# Installs come from uv.lock, so a fresh clone on any day gets exactly the versions CI
# last passed with. uv itself is pinned here and installed once into .tools/.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
UV_VERSION := 0.13.9
TOOLS := .tools
UV := $(TOOLS)/bin/uv
RUN_STAMP := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test
# uv uses the machine's Python (never downloads one) and installs into $(VENV).
UV_ENV := UV_PYTHON_DOWNLOADS=never UV_PROJECT_ENVIRONMENT=$(VENV)

.PHONY: run test install lint typecheck pytest k8s-bins bench bench-deps image clean lock \
	test-latest

$(UV):
	@echo "make: [1/3] installing uv $(UV_VERSION), the installer of uv.lock, into $(TOOLS)/"
	@$(PYTHON) -m venv $(TOOLS)
	@$(TOOLS)/bin/pip install --quiet --disable-pip-version-check uv==$(UV_VERSION)

# What the agent needs (`.[all]`): `make run` installs no test tools. A venv that has
# the test install already has all of it.
$(RUN_STAMP): pyproject.toml uv.lock | $(UV)
	@if [ -f $(TEST_STAMP) ] && [ $(TEST_STAMP) -nt uv.lock ] && [ $(TEST_STAMP) -nt pyproject.toml ]; then \
	  echo "make: [2/3] $(VENV) is up to date with uv.lock"; \
	else \
	  echo "make: [2/3] installing gpulet and what it runs with (.[all]) from uv.lock into $(VENV)/"; \
	  $(UV_ENV) $(UV) sync --quiet --frozen --inexact --extra all --python $(PYTHON); \
	fi
	@touch $@

$(TEST_STAMP): pyproject.toml uv.lock | $(UV)
	@echo "make: installing gpulet with its test tools (.[test]) from uv.lock into $(VENV)/"
	@$(UV_ENV) $(UV) sync --quiet --frozen --extra test --python $(PYTHON)
	@touch $@

install: $(TEST_STAMP)

# Real NVML when nvidia-smi sees a GPU, otherwise the mock 8x H100 node.
run: $(RUN_STAMP)
	@if nvidia-smi -L >/dev/null 2>&1; then nvml=nvml; else nvml=mock; \
	  echo "make: [3/3] no NVIDIA GPU found: running against the mock NVML (scenario dgx-h100)"; fi; \
	exec $(BIN)/gpulet run --nvml $$nvml --state-dir .gpulet $(ARGS)

# uv.lock upgraded to the newest versions pyproject.toml allows, and requirements/all.txt
# (what the image installs, with hashes) exported from it; uv prints each change.
lock: | $(UV)
	$(UV_ENV) $(UV) lock --upgrade --python $(PYTHON)
	$(UV) export --frozen --extra all --no-emit-project --no-header --format requirements-txt \
	  --output-file requirements/all.txt >/dev/null
	@git --no-pager diff --stat -- uv.lock requirements/all.txt 2>/dev/null || true

# The suite on the newest versions pyproject.toml allows, in .venv-latest (uv.lock is
# not read or changed): how a new release is met on purpose, before `make lock`.
LATEST := .venv-latest
test-latest: | $(UV)
	@echo "make: installing the newest allowed versions into $(LATEST)/ (not from uv.lock)"
	@UV_PYTHON_DOWNLOADS=never $(UV) venv --quiet --allow-existing --python $(PYTHON) $(LATEST)
	@VIRTUAL_ENV=$(LATEST) $(UV) pip install --quiet --upgrade -e '.[test]'
	@echo "make: versions that differ from uv.lock:"
	@$(UV) export --frozen --extra test --no-emit-project --no-hashes --no-header \
	  --format requirements-txt | sed -n 's/^\([A-Za-z0-9_.-]*==[^ ;]*\).*/\1/p' | sort -f >$(LATEST)/locked.txt
	@VIRTUAL_ENV=$(LATEST) $(UV) pip freeze --exclude-editable | sort -f >$(LATEST)/latest.txt
	@comm -13 $(LATEST)/locked.txt $(LATEST)/latest.txt | sed 's/^/  /'
	@touch $(LATEST)/.latest  # newer than uv.lock: the sub-make installs nothing
	$(MAKE) --no-print-directory lint typecheck pytest VENV=$(LATEST) TEST_STAMP=$(LATEST)/.latest

lint: $(TEST_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(TEST_STAMP)
	$(BIN)/mypy

# Two workers (the CI machine has 2 cores), a test file per worker at a time: the suite
# waits on servers much of its time. PYTEST_ARGS= runs it in one process.
PYTEST_ARGS ?= -n 2 --dist loadfile

# Bytecode is written even where the environment says not to (PYTHONDONTWRITEBYTECODE):
# the suite starts `gpulet` in many child processes (agents, sidecars, CLI runs), and
# without the .pyc files (kept out of git and of the image by .gitignore and
# .dockerignore) each one compiles gpulet's modules again: tests/cli/test_cli_errors.py,
# 34 processes, took 30 s instead of 23 s.
pytest: $(TEST_STAMP) k8s-bins
	PYTHONDONTWRITEBYTECODE= $(BIN)/pytest -q $(PYTEST_ARGS)

# The real control plane of tests/kube (etcd, kube-apiserver, kube-scheduler,
# kube-controller-manager) and helm, built from their Go modules (tools/k8s) into
# ~/.cache/gpulet/k8s once per machine; docs/testing.md has the build times.
k8s-bins:
	@scripts/k8s-bins.sh --check || { \
	  echo "make: the real control plane's binaries (tools/k8s) are not built yet: building them now with scripts/k8s-bins.sh (once per machine; see docs/testing.md)"; \
	  scripts/k8s-bins.sh; }

test: lint typecheck pytest

bench: $(TEST_STAMP) bench-deps
	$(BIN)/python bench/run_all.py

# Go and grpc-go for the kubelet stand-in of bench/allocate_roundtrip.py (Debian
# packages, installed when missing); without them that bench uses a Python client.
GO_DEPS := golang-go golang-google-grpc-dev
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
bench-deps:
	@if ! command -v go >/dev/null 2>&1 || [ ! -d /usr/share/gocode/src/google.golang.org/grpc ]; then \
	  $(SUDO) apt-get install -y $(GO_DEPS) || \
	  { $(SUDO) apt-get update && $(SUDO) apt-get install -y $(GO_DEPS); } || \
	  echo "note: could not install $(GO_DEPS): bench/allocate_roundtrip.py will use its Python kubelet stand-in"; \
	fi

# The container images, with podman (or docker where a Docker engine runs): gpulet
# ($(IMAGE)) and the NATS sidecar ($(NATS_IMAGE)). BASE_IMAGE=auto takes python:3.11-slim
# when it can be had, else a Debian bookworm base made with debootstrap and kept (see
# scripts/image.sh). Needs no .venv.
IMAGE ?= gpulet:dev
NATS_IMAGE ?= gpulet-nats:dev
BASE_IMAGE ?= auto
image:
	IMAGE=$(IMAGE) NATS_IMAGE=$(NATS_IMAGE) BASE_IMAGE=$(BASE_IMAGE) scripts/image.sh build

clean:
	rm -rf $(VENV) $(LATEST) $(TOOLS) .gpulet .mypy_cache .ruff_cache
