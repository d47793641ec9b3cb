# detrl — `make help` lists the targets.
PYTHON ?= python
# the CPU build of torch that this project is tested with; override on GPU machines (TORCH="torch")
TORCH ?= torch==2.13.0

.PHONY: help install install-test train test lint format matrix

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-8s %s\n", $$1, $$2}'

install:  ## install detrl (editable)
	$(PYTHON) -m pip install -q "$(TORCH)" -e .

install-test: install  ## install the test tools, and SGLang's classes for the contract tests (never its dependencies)
	$(PYTHON) -m pip install -q -e ".[test]"
	$(PYTHON) -m pip install -q --no-deps "sglang==0.5.23" "triton==3.9.0"
	$(PYTHON) -m pip install -q pybase64 msgspec aiohttp orjson  # what its server_args and sampling_params import

train: install  ## set up, then train the default: tiny Qwen3, GRPO, determinism on, CPU (~20 s)
	$(PYTHON) train.py

test: install-test  ## set up, then run the test suite (CPU; GPU-only tests skip)
	DETRL_REQUIRE_SGLANG=1 $(PYTHON) -m pytest -q

lint:  ## ruff
	$(PYTHON) -m ruff check src tests train.py benchmarks

format:  ## ruff format + import order
	$(PYTHON) -m ruff check --fix src tests train.py benchmarks
	$(PYTHON) -m ruff format src tests train.py benchmarks

matrix: install  ## run the determinism_matrix study, then render its report into docs/determinism_matrix/
	rm -rf outputs/sweeps/determinism_matrix_latest
	$(PYTHON) train.py -m experiment=determinism_matrix hydra.sweep.dir=outputs/sweeps/determinism_matrix_latest
	$(PYTHON) -m detrl.report outputs/sweeps/determinism_matrix_latest --out docs/determinism_matrix
