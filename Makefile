# detrl — `make help` lists the targets.
# Everything runs in a project virtual environment, .venv/ (created on first use, git-ignored), so neither the
# machine's global site-packages nor a user's can make a run pass or fail. `source .venv/bin/activate` to use it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# the CPU build of torch that this project is tested with; override on GPU machines (TORCH="torch")
TORCH ?= torch==2.13.0
# SGLang's classes for the contract tests, without its dependencies (it would replace torch and transformers),
# plus every third-party module that the sglang modules the contract tests load import at module level
# (listed from SGLang 0.5.23's own files by tests/sglang_imports.py, which a test re-runs)
SGLANG := sglang==0.5.23 triton==3.9.0
SGLANG_IMPORTS := ipython pillow aiohttp msgspec numpy orjson packaging psutil pybase64 pydantic requests \
	starlette tqdm typing-extensions pyzmq

.PHONY: help install install-test train test lint format matrix ablation notebook clean-venv

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(VENV)/.installed: $(PY) pyproject.toml
	$(PY) -m pip install -q "$(TORCH)" -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps $(SGLANG)
	$(PY) -m pip install -q $(SGLANG_IMPORTS)
	touch $@

$(VENV)/.installed-notebook: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[notebook]"
	touch $@

install: $(VENV)/.installed  ## create .venv (once) and install detrl into it (editable)

install-test: $(VENV)/.installed-test  ## ... plus the test tools and SGLang's classes for the contract tests

train: install  ## set up (first time: minutes), then train the default: tiny Qwen3, GRPO, determinism on, CPU (~40 s)
	$(PY) train.py

test: install-test  ## set up, then run the test suite (CPU; tests marked gpu skip without CUDA)
	DETRL_REQUIRE_SGLANG=1 $(PY) -m pytest -q -n 2 --dist loadfile

lint: install-test  ## ruff check + ruff format --check (CI runs this before the tests)
	$(PY) -m ruff check src tests train.py benchmarks scripts
	$(PY) -m ruff format --check src tests train.py benchmarks scripts

format: install-test  ## ruff format + import order
	$(PY) -m ruff check --fix src tests train.py benchmarks scripts
	$(PY) -m ruff format src tests train.py benchmarks scripts

ablation: install  ## ablate each source of nondeterminism (conf/ablation/), then render its report into docs/source_ablation/
	rm -rf outputs/sweeps/source_ablation_latest
	$(PY) train.py -m experiment=source_ablation hydra.sweep.dir=outputs/sweeps/source_ablation_latest
	$(PY) -m detrl.report outputs/sweeps/source_ablation_latest --out docs/source_ablation

matrix: install  ## run the determinism_matrix study, then render its report into docs/determinism_matrix/
	rm -rf outputs/sweeps/determinism_matrix_latest
	$(PY) train.py -m experiment=determinism_matrix hydra.sweep.dir=outputs/sweeps/determinism_matrix_latest
	$(PY) -m detrl.report outputs/sweeps/determinism_matrix_latest --out docs/determinism_matrix

SWEEP ?= outputs/sweeps/smoke_latest
notebook: $(VENV)/.installed-notebook  ## run the report notebook headless on SWEEP= (default: the smoke sweep, run first if absent)
	test -d $(SWEEP) || $(PY) train.py -m experiment=smoke hydra.sweep.dir=$(SWEEP)
	$(PY) notebooks/run.py $(SWEEP)

clean-venv:  ## remove .venv (the next make target rebuilds it from nothing)
	rm -rf $(VENV)
