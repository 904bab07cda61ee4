# Two entry points for a fresh machine: `make train` (the main job) and `make test`.
# Both create the virtual environment on first use. Override VENV, PYTHON or TORCH as needed,
# e.g. `make test TORCH='torch==2.13.0'` or a CUDA build on a GPU machine.
VENV ?= .venv
PYTHON ?= python3
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.hf_zero-installed

.PHONY: setup train test test-fast lint format

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

# The main job: ZeRO-2 fine-tune of the embedded tiny Llama on the embedded text, 2 ranks.
train: setup
	OMP_NUM_THREADS=1 $(BIN)/torchrun --standalone --nproc_per_node 2 \
		recipes/train_tiny.py --zero_stage 2 --output_dir outputs/tiny-zero2

test: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest

# World-size-4 cases deselected: for quick local iterations only (CI runs `make test`).
test-fast: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -m "not slow"

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .
