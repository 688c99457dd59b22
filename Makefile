# Two commands on a fresh machine: `make demo` (the main job) and `make test` (the tests).
# Both create or reuse the virtual environment and install what they need.
VENV ?= .venv
PY := $(VENV)/bin/python
# torch goes in first, pinned. Which build pip finds depends on the index: on Linux x86_64 PyPI's
# torch==2.13.0 is the CUDA 13.0 build (NVIDIA driver 580 or later), the one `make gpu-check`
# needs; this project's CI installs the CPU build (2.13.0+cpu) from its local wheel index. A venv
# that already imports torch keeps the build it has: remove .venv to change it.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: venv demo test lint clean gpu-check gpu-bundle docker-build docker-config

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# torch first and pinned, so no other package pulls a multi-GB CUDA build by itself
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[serve,postgres,dev]'
	@touch $@

demo: $(STAMP)
	$(VENV)/bin/loraplane demo

test: $(STAMP)
	$(PY) -m pytest -q -ra --durations=25

lint: $(STAMP)
	$(VENV)/bin/ruff check control projections backend tests model_repository $(wildcard bench)
	$(VENV)/bin/mypy control projections backend
	$(VENV)/bin/lint-imports

# The engine's GPU checks in one call (control/tools/bench/gpu_check.py), a few minutes on a GPU; prints a
# JSON report and fails when a check does. Needs a CUDA build of torch in the venv (TORCH_SPEC).
# Dry run on any machine, toy sizes (what CI runs in tests/control/tools/bench/test_gpu_check.py):
#   make gpu-check GPU_CHECK_ARGS='--device cpu'
GPU_CHECK_ARGS ?=
gpu-check: $(STAMP)
	$(PY) -m control.tools.bench.gpu_check $(GPU_CHECK_ARGS)

# A folder from which the GPU check runs on a host with no network (a lent GPU machine): the
# project's source, wheels from PyPI for CPython 3.12 on manylinux x86_64 of everything the check
# imports except torch and its CUDA stack (the image's own), and a run script. On the host:
#   build/gpu-bundle/gpu-check            (PYTHON=... picks the interpreter that has torch)
# GPU_BUNDLE_ARGS='--from-env' packs this venv's installed packages instead, offline (CI does).
GPU_BUNDLE_DIR ?= build/gpu-bundle
GPU_BUNDLE_ARGS ?=
gpu-bundle: $(STAMP)
	$(PY) -m control.tools.bench.gpu_bundle --out $(GPU_BUNDLE_DIR) $(GPU_BUNDLE_ARGS)

clean:
	rm -rf .loraplane .pytest_cache .mypy_cache .ruff_cache

# Container images (needs a Docker engine; see README "Run it for real").
# docker/triton.Dockerfile refuses Triton releases before 25.07 (the August 2025 advisories)
TRITON_TAG ?= 25.10-py3
docker-build:
	docker build -f docker/triton.Dockerfile --build-arg TRITON_TAG=$(TRITON_TAG) -t loraplane/triton:0.1.0 .
	docker build -f docker/control.Dockerfile -t loraplane/control:0.1.0 .

docker-config:
	docker-compose -f docker/compose.yaml config -q
