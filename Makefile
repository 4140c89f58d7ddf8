# hfscale — set-up, demo and tests. `make demo` and `make test` do everything on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# torch goes first and alone: a bare `torch` requirement resolves to a multi-GB CUDA build.
# On a CUDA-less host without a local CPU wheel, point TORCH_PIP_ARGS at PyTorch's CPU wheel index.
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
STAMP := $(VENV)/.hfscale-installed

export HF_HUB_OFFLINE ?= 1
# The venv's tools first, for install and tests alike: DeepSpeed's JIT ops are built by the `ninja` first on PATH, and
# Debian's ninja 1.11 and the venv's 1.13 (a torch dependency) keep incompatible build logs, so every switch between
# them rebuilt cpu_adam / shm / async_io (measured: 190 s inside one suite; any test that puts the venv on PATH did it)
export PATH := $(abspath $(VENV))/bin:$(PATH)
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install demo test test-fast test-avx2 configs clean

install: $(STAMP)

$(STAMP): pyproject.toml requirements.lock
	@# libaio headers for DeepSpeed's async_io op (NVMe offload); installed with apt where we may
	@test -f /usr/include/libaio.h || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libaio-dev >/dev/null; } ; } || \
	  echo "warning: libaio-dev missing and not installable here: NVMe offload will not run"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"
	$(PIP) install -q -c requirements.lock transformers accelerate peft bitsandbytes datasets torchao
	# deepspeed builds against the torch already installed (its own build env would pull another)
	$(PIP) install -q --no-build-isolation -c requirements.lock deepspeed
	# DeepSpeed's CPU ops (cpu_adam, shm collectives, async_io / pin_memory for NVMe) built now, not in the first run
	$(PY) tools/prebuild_deepspeed_ops.py
	# edge runtimes: GGUF writer, ExecuTorch (beside torch, not replacing it), llama.cpp via its Python binding
	$(PIP) install -q -c requirements.lock gguf executorch
	$(PIP) install -q -c requirements.lock llama-cpp-python
	# the project with every extra ([all]: deepspeed, quant, edge, plot) and the test tools; all of it is
	# installed above in the safe order, so this adds only hfscale itself and the small pure-Python pieces
	$(PIP) install -q -c requirements.lock -e ".[all,test]"
	$(PY) -c "import torch, transformers, accelerate, deepspeed, peft, datasets, torchao, bitsandbytes, gguf, executorch, llama_cpp, matplotlib; print('installed: torch', torch.__version__, '| deepspeed', deepspeed.__version__)"
	touch $@

demo: install
	$(VENV)/bin/hfscale demo

# The in-process tests (not engine, not slow: ~650, mostly one thread of Python; 531 s -> 344 s on 2 workers) and the
# slow ones that mostly keep one core busy (onecore: pip, CLI subprocesses) on two pytest-xdist workers, a file per
# worker at a time (docs/install.md); then the launches, fixtures and real runtimes one at a time, as each
# uses both cores itself. Both parts always run; the status fails if either failed.
SUITE = $(PY) -m pytest -q -ra -p no:cacheprovider
PART1 = $(SUITE) -m "not engine and (not slow or onecore)" -n 2 --dist loadfile --durations=10
PART2 = $(SUITE) -m "engine or (slow and not onecore)" --durations=30
test: install
	$(PART1); a=$$?; $(PART2); b=$$?; exit $$(( a || b ))

# a few minutes: no multi-process launch, no fixture training, no llama.cpp / ExecuTorch / real-step subprocess
test-fast: install
	$(PY) -m pytest -q -ra -m "not engine and not slow" --durations=10

# The suite as a 2-core AVX2 host (AMD EPYC class) runs it, on an AVX512 machine: torch's AVX2 kernels, oneDNN capped
# at AVX2 (bf16 emulated), hfscale's precision `auto` as without native bf16, and MKL on its SSE4.2 path, the one
# whose alignment-dependent gemv rounding AMD hosts showed (docs/install.md: what it reproduces, how its times compare)
AVX2_ENV := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=SSE4_2 HFSCALE_NATIVE_BF16=0
test-avx2: install
	export $(AVX2_ENV); $(PART1); a=$$?; $(PART2); b=$$?; exit $$(( a || b ))

# Regenerate every shipped config from the CLI (the tests fail on drift from this).
configs: install
	$(VENV)/bin/hfscale config --all --out-accelerate accelerate_configs --out-deepspeed ds_configs --force

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
