# detrl — `make help` lists the targets.
PYTHON ?= python
# the CPU build of torch that this project is tested with; override on GPU machines (TORCH="torch")
TORCH ?= torch==2.13.0

.PHONY: help install train test lint format matrix

help:  ## list the targets
	@grep -E '^[a-z]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-8s %s\n", $$1, $$2}'

install:  ## install detrl (editable) with its test tools
	$(PYTHON) -m pip install -q "$(TORCH)" -e ".[test]"

train: install  ## set up, then train the default: tiny Qwen3, GRPO, determinism on, CPU (~20 s)
	$(PYTHON) train.py

test: install  ## set up, then run the test suite (CPU; GPU-only tests skip)
	$(PYTHON) -m pytest -q

lint:  ## ruff
	$(PYTHON) -m ruff check src tests train.py benchmarks

format:  ## ruff format + import order
	$(PYTHON) -m ruff check --fix src tests train.py benchmarks
	$(PYTHON) -m ruff format src tests train.py benchmarks

matrix: install  ## run the determinism_matrix study, then render its report into docs/determinism_matrix/
	rm -rf outputs/sweeps/determinism_matrix_latest
	$(PYTHON) train.py -m experiment=determinism_matrix hydra.sweep.dir=outputs/sweeps/determinism_matrix_latest
	$(PYTHON) -m detrl.report outputs/sweeps/determinism_matrix_latest --out docs/determinism_matrix
