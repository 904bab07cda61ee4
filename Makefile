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

# The main job: LoRA fine-tune of the embedded tiny Llama on the embedded text with ZeRO-3,
# two CPU processes (or GPUs) through `accelerate launch` and the Trainer.
train: setup
	OMP_NUM_THREADS=1 $(BIN)/accelerate launch --config_file configs/accelerate/cpu_2proc.yaml \
		recipes/finetune_lora.py --zero_stage 3 --output_dir outputs/lora-zero3 \
		--max_steps 150 --learning_rate 1e-2 --per_device_train_batch_size 8 \
		--logging_steps 25 --save_strategy no --report_to none

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
