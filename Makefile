# shardserve: `make test` and `make demo` set everything up from nothing (Python 3.11 + pip).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The CPU wheel: an unpinned torch would pull gigabytes of CUDA packages.
TORCH_SPEC ?= torch==2.13.0

.PHONY: test demo install clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

demo: $(STAMP)
	$(VENV)/bin/shardserve plan --model gpt2 --hardware cpu

clean:
	rm -rf $(VENV) build *.egg-info
