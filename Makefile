# Two commands: `make demo` (a short CPU tour) and `make test` (the full CPU test suite); `make test-fast` runs
# the core of every part in a few minutes.
# Both create .venv with a Python >= 3.12 when missing and install the project with its extras.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# A Python >= 3.12 (3.12 preferred: the GPU image runs it): PATH first, then pyenv's versions.
FIND_PYTHON := for c in python3.12 python3.13 python3.14 python3 \
	$$(ls -d $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.1[2-9]*/bin/python3 2>/dev/null | sort -V); do \
	  if "$$c" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; then echo "$$c"; break; fi; \
	done

.PHONY: demo test test-fast lint venv clean browser gpu-check device-wheels

$(STAMP): pyproject.toml constraints.txt
	@if [ ! -x $(PY) ]; then \
	  base=$$($(FIND_PYTHON)); \
	  if [ -z "$$base" ]; then \
	    echo "error: apex-jax needs Python >= 3.12 (jax 0.11 requires it). Install one, e.g." >&2; \
	    echo "  pyenv install 3.12  or  apt-get install python3.12-venv" >&2; exit 1; \
	  fi; \
	  echo "creating $(VENV) with $$base"; rm -rf $(VENV); "$$base" -m venv $(VENV); \
	fi
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test,demo,bench]'
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) -m examples.tour

# The dashboard's browser test drives Debian's chromium: installed here when apt-get can (as root); otherwise that
# test skips and says how to install it.
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; } || \
	  echo "note: no chromium/chromedriver: the dashboard browser test will skip (apt-get install chromium chromium-driver)"

test: $(STAMP) browser
	$(PY) -m ruff check .
	# Two worker processes, each taking whole files (module fixtures stay shared): the suite takes about half as long
	# on 2 cores, and no single process accumulates every compiled executable of the suite. A worker that dies
	# (a crash, or a test past its timeout: pytest-timeout's thread method dumps every stack and exits) ends the run
	# at once: xdist's file scheduler stalls after replacing a worker, waiting for files nobody runs.
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --max-worker-restart=0

# The core of every part, not marked slow: the optimizer and its checkpoints, the datasets, a Pallas kernel in
# interpret mode and lowered for an H200, the PC core, the serving layers, loaders, scheduler, sampler and engine
# against HF's greedy tokens, both HTTP APIs, and one smoke test per part (tests/test_smoke.py).
FAST_TESTS := tests/test_smoke.py tests/test_import_graph.py tests/apex_jax/test_apexw.py tests/apex_jax/test_checkpoint.py \
	tests/apex_data/test_data.py tests/pallas_kernels/test_adamw_kernel.py tests/pallas_kernels/test_pallas_matmul.py \
	tests/pallas_kernels/test_pallas_device.py tests/pc/test_pc_core.py tests/pc/test_pc_variants.py \
	tests/serving/test_serving_package.py tests/serving/test_serving_config.py tests/serving/test_serving_layers.py \
	tests/serving/test_serving_tokenizer.py tests/serving/test_hf_fixtures.py tests/serving/loaders/test_serving_gguf.py \
	tests/serving/engine/test_serving_blocks.py tests/serving/engine/test_serving_scheduler.py \
	tests/serving/engine/test_serving_sampler.py tests/serving/engine/test_serving_engine.py \
	tests/serving/api/test_serving_api.py tests/serving/api/test_serving_tools.py \
	tests/serving/api/test_serving_api_security.py tests/benchmarks/test_bench_harness.py

test-fast: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile -m "not slow" $(FAST_TESTS)

# On the GPU machine, with its own python3 (no venv; carry .whl): every kernel test file and a smoke test of each
# part, compiled, in one table; JSON under $$OUT or benchmarks/results/gpu_check.json. ARGS="-k NAME,NAME" for some jobs;
# ARGS="--set parts" (a second command) for the parts' test files that run the kernels by default, ARGS="--set engine"
# (a third) for the engine's, speculative decoding's and the PC networks'.
gpu-check:
	python3 -m tools.gpu_check $(ARGS)

# Here, where pip works: the wheels the GPU machine lacks, into the git-ignored .whl/ (carry [".whl"]).
device-wheels: $(STAMP)
	$(PY) -m tools.device_wheels

lint: $(STAMP)
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV)
