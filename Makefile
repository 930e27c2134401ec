# The two commands a newcomer needs:
#   make run   - install into .venv and run every service (mock GPUs when there is no GPU)
#   make test  - install into .venv and run lint, type checks and the test suite
#                (IMAGE_TESTS=1 make test adds the image tests, as CI runs it)
# and for containers:
#   make image - the gpulet image and its NATS sidecar image (podman or docker)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test install lint typecheck pytest k8s-bins bench bench-deps image clean

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

# Two workers (the CI machine has 2 cores), a test file per worker at a time: the suite
# waits on servers much of its time. PYTEST_ARGS= runs it in one process.
PYTEST_ARGS ?= -n 2 --dist loadfile

# Bytecode is written even where the environment says not to (PYTHONDONTWRITEBYTECODE):
# the suite starts `gpulet` in many child processes (agents, sidecars, CLI runs), and
# without the .pyc files (kept out of git and of the image by .gitignore and
# .dockerignore) each one compiles gpulet's modules again: tests/cli/test_cli_errors.py,
# 34 processes, took 30 s instead of 23 s.
pytest: $(STAMP) k8s-bins
	PYTHONDONTWRITEBYTECODE= $(BIN)/pytest -q $(PYTEST_ARGS)

# The real control plane of tests/kube (etcd, kube-apiserver, kube-scheduler,
# kube-controller-manager) and helm, built from their Go modules (tools/k8s) into
# ~/.cache/gpulet/k8s once per machine; docs/testing.md has the build times.
k8s-bins:
	@scripts/k8s-bins.sh --check || { \
	  echo "make: the real control plane's binaries (tools/k8s) are not built yet: building them now with scripts/k8s-bins.sh (once per machine; see docs/testing.md)"; \
	  scripts/k8s-bins.sh; }

test: lint typecheck pytest

bench: $(STAMP) bench-deps
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
	rm -rf $(VENV) .gpulet .mypy_cache .ruff_cache
