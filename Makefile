# shardserve: `make test` and `make demo` set everything up from nothing (Python 3.11 + pip).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# What serving needs (`make demo`), then the test and lint tools on top (`make install`, `make test`).
SERVE_STAMP := $(VENV)/.installed-serve
STAMP := $(VENV)/.installed
# The CPU wheel: an unpinned torch would pull gigabytes of CUDA packages.
TORCH_SPEC ?= torch==2.13.0
# `make install-gpu`: the same torch from PyTorch's CUDA index. cu130 (CUDA 13.0, torch 2.13's stable
# build) needs NVIDIA driver 580 or later; TORCH_INDEX=https://download.pytorch.org/whl/cu126 for older.
TORCH_INDEX ?= https://download.pytorch.org/whl/cu130
# What a GPU server installs beside torch (the Dockerfile's EXTRAS too).
SERVER_EXTRAS := gpu,ray
GPU_STAMP := $(VENV)/.installed-gpu
# Each install step says what it fetches, and pip shows its progress.
STEP = @printf '\n==> %s\n' 

.PHONY: test test-fast lint demo install install-serve install-gpu clean

install: $(STAMP)

install-serve: $(SERVE_STAMP)

# The venv of `make install` with the CUDA build of torch (replacing a CPU build of the same version),
# then `shardserve doctor` says whether CUDA, Triton and NCCL work here. `make test` and `make demo`
# use it as it is.
install-gpu: $(GPU_STAMP)
	$(VENV)/bin/shardserve doctor

$(GPU_STAMP): pyproject.toml setup.py
	$(STEP) "[1/3] $(VENV): a virtual environment with the latest pip"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(STEP) "[2/3] torch's CUDA wheel ($(TORCH_SPEC) from $(TORCH_INDEX))"
	$(PY) -c 'import torch, sys; sys.exit(torch.version.cuda is None)' 2>/dev/null || $(PY) -m pip uninstall --yes torch
	$(PY) -m pip install "$(TORCH_SPEC)" --index-url $(TORCH_INDEX)
	$(STEP) "[3/3] shardserve, editable, with what a GPU server needs and the test tools (.[$(SERVER_EXTRAS),test])"
	$(PY) -m pip install -e '.[$(SERVER_EXTRAS),test]'
	touch $(SERVE_STAMP) $(STAMP) $(GPU_STAMP)

$(SERVE_STAMP): pyproject.toml setup.py
	$(STEP) "[1/3] $(VENV): a virtual environment with the latest pip"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(STEP) "[2/3] torch's CPU wheel ($(TORCH_SPEC), about 750 MB installed)"
	$(PY) -m pip install "$(TORCH_SPEC)"
	$(STEP) "[3/3] shardserve, editable, with what serving needs (.[runtime])"
	$(PY) -m pip install -e '.[runtime]'
	touch $(SERVE_STAMP)

$(STAMP): $(SERVE_STAMP)
	$(STEP) "the test and lint tools (.[test]: Triton for its interpreter, Ray, pytest, ruff, mypy...)"
	$(PY) -m pip install -e '.[test]'
	touch $(STAMP)

# Lint, then the whole suite, as CI runs it: first the tests marked serial, alone on a quiet machine since they
# time it, then the rest on TEST_WORKERS workers (pytest-xdist; a module's tests stay on one worker, sharing its
# server). A fresh clone's CI run, installs included: 22 min on two CPU cores (serial 1 min, the rest 18.4).
TEST_WORKERS ?= 2
# NOTE: the suite starts hundreds of interpreters (servers, ranks, the CLI); each imports this tree's modules
# faster from bytecode caches, which an environment's PYTHONDONTWRITEBYTECODE would forbid.
test: export PYTHONDONTWRITEBYTECODE :=
test: lint
	$(PY) -m pytest -q -m serial
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not serial"

# ruff and mypy as pyproject.toml configures them (mypy: about 40 s on a cold .mypy_cache, 2 s warm).
# mypy cannot read the package-dir mapping, so it reads the packages through links in build/mypy-path;
# the empty shardserve/__init__.py keeps it from taking the data folder planner/catalog/ for catalog.py.
lint: $(STAMP)
	$(PY) -m ruff check --quiet .
	@mkdir -p build/mypy-path/shardserve && touch build/mypy-path/shardserve/__init__.py
	@for p in planner runtime launch; do ln -sfn ../../../$$p build/mypy-path/shardserve/$$p; done
	$(PY) -m mypy

# Everything but the tests marked slow, in one process that starts none (tests/conftest.py fails a test that
# does): while editing, 3 to 5 minutes.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

demo: $(SERVE_STAMP)
	@echo "Serving the bundled demo model on http://localhost:8000 (Ctrl-C stops it). Try:"
	@echo "  curl http://localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\"
	@echo "    -d '{\"model\": \"shardserve-demo\", \"messages\": [{\"role\": \"user\", \"content\": \"What is a list?\"}], \"max_tokens\": 48, \"temperature\": 0.7}'"
	@echo "  curl http://localhost:8000/v1/completions -H 'Content-Type: application/json' \\"
	@echo "    -d '{\"model\": \"shardserve-demo\", \"prompt\": \"The function\", \"max_tokens\": 32}'"
	$(VENV)/bin/shardserve launch --profile demo

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache
