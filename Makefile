# Two entry points for a fresh machine: `make train` (the main job) and `make test`.
# Both create the virtual environment on first use. Override VENV, PYTHON or TORCH as needed,
# e.g. `make test TORCH='torch==2.13.0'` or a CUDA build on a GPU machine.
VENV ?= .venv
PYTHON ?= python3
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.hf_zero-installed

.PHONY: setup train test test-fast test-avx2 lint format notebooks gpu-check gpu-wheels

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

# The main job: LoRA fine-tune of the embedded tiny Llama on the embedded text with ZeRO-3,
# two CPU processes (or GPUs) through `accelerate launch` and the Trainer.
ACCELERATE_CONFIG ?= configs/accelerate/cpu_2proc.yaml
TRAIN_OUT ?= outputs/lora-zero3
train: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m accelerate.commands.launch --config_file $(ACCELERATE_CONFIG) \
		recipes/finetune_lora.py --zero_stage 3 --output_dir $(TRAIN_OUT) \
		--max_steps 150 --learning_rate 1e-2 --per_device_train_batch_size 8 \
		--logging_steps 25 --save_strategy no --report_to none

# Two pytest workers, each in a network namespace of its own (tests/conftest.py; needs root),
# each taking whole test files in the order tests/conftest.py gives them (longest first; xdist
# would otherwise order files by their number of cases). WORKERS=0 runs everything in one process.
WORKERS ?= 2
PYTEST := OMP_NUM_THREADS=1 $(BIN)/python -m pytest \
	-n $(WORKERS) --dist loadfile --no-loadscope-reorder

test: setup
	$(PYTEST)

# The edit-test loop: every package folder, without the cases marked `slow` (world size 4) or
# `long` (launches processes as a user does, or trains at length: tests/conftest.py). About 3
# minutes on a 2-core CPU machine; CI runs everything (`make test`).
test-fast: setup
	$(PYTEST) -m "not slow and not long"

# Everything, computing as a CPU without bf16 instructions does (oneDNN and ATen limited to AVX2:
# bf16 matmuls take other kernels, which round at other points, ~70x slower): on a CPU with
# `avx512_bf16`, the check that tolerances hold for AVX2-only machines too.
AVX2_ONLY := ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2
test-avx2: setup
	$(AVX2_ONLY) $(PYTEST)

# Re-run the notebooks and store their outputs (tests/end_to_end/test_notebooks.py checks they are current).
notebooks: setup
	$(BIN)/python scripts/execute_notebooks.py

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# The GPU lane (docs/GPU.md): on a machine without a visible NVIDIA GPU it says so and exits 0.
gpu-check:
	bash scripts/gpu_check.sh

# Wheels for a GPU machine that cannot reach a package index (python 3.12, x86-64 Linux): what
# hf_zero needs beyond an image with torch, transformers, accelerate, peft and safetensors.
GPU_WHEELS ?= datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 bitsandbytes==0.50.2
gpu-wheels:
	python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 -d .whl $(GPU_WHEELS)
