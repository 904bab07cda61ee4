"""Faults, each in its own `accelerate launch` of a recipe (2 CPU ranks), and what survives.

* Every rank SIGKILLed in the middle of a checkpoint save (two moments: the engine's shards
  written but not published; everything but ``trainer_state.json`` written): the newest folder
  ``get_last_checkpoint()`` returns is the previous, complete checkpoint; nothing else looks like
  one; ``--resume_from_checkpoint true`` resumes from it to the losses of an uninterrupted run,
  and the interrupted save's debris is gone.
* A full disk (ENOSPC while writing the engine's shards): the run fails with an error naming the
  folder and the space free; the previous checkpoint is untouched and resumable.
* A stage-3 model built inside ``partitioned_init()`` (``finetune_full.py --model_config``)
  resumes exactly (its empty parameters are filled from the checkpoint's slices).
* Ranks that built different models (a wider hidden size, one more layer) fail at
  `initialize`, every rank with the same error naming the first differing parameter, in
  seconds instead of a crash at the first forward or a hang until the collective timeout.

The faults are injected by ``tests/scripts/faulty_recipe.py`` around the unchanged recipe.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import MODEL
from transformers.trainer_utils import get_last_checkpoint

import hf_zero
from hf_zero.integrations.trainer_checkpoints import STAGING
from hf_zero.testing import run_distributed
from hf_zero.tiny import tiny_llama, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _launch(out: Path, *flags: str, recipe: str = "finetune_lora", fault: str | None = None):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "recipes"))
    script = ROOT / "recipes" / f"{recipe}.py"
    if fault is not None:
        env.update(HF_ZERO_TEST_FAULT=fault, HF_ZERO_TEST_RECIPE=recipe)
        script = ROOT / "tests/scripts/faulty_recipe.py"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file"]
    cmd += [str(ROOT / "configs/accelerate/cpu_2proc.yaml"), str(script)]
    cmd += ["--max_steps", "6", "--learning_rate", "1e-2", "--per_device_train_batch_size", "4"]
    cmd += ["--save_strategy", "steps", "--save_steps", "2", "--logging_steps", "1"]
    cmd += ["--report_to", "none", "--disable_tqdm", "true", "--output_dir", str(out), *flags]
    return subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT,
        start_new_session=True,  # a fault that kills its process group kills only this run
    )  # fmt: skip


def _losses(out: Path) -> dict[int, float]:
    history = json.loads((out / "log_history.json").read_text())
    return {e["step"]: e["loss"] for e in history if "loss" in e}


def _complete(checkpoint: Path) -> bool:
    names = {p.name for p in checkpoint.iterdir()}
    return {"trainer_state.json", "scheduler.pt", "zero"} <= names


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, float]:
    out = tmp_path_factory.mktemp("faults") / "whole"
    done = _launch(out, "--zero_stage", "3")
    assert done.returncode == 0, done.stderr[-4000:]
    return _losses(out)


@pytest.mark.parametrize("fault", ["kill-engine-save", "kill-before-state"])
def test_a_save_killed_midway_leaves_the_last_checkpoint_resumable(tmp_path, uninterrupted, fault):
    out = tmp_path / "out"
    killed = _launch(out, "--zero_stage", "3", fault=f"{fault}@checkpoint-4")
    assert killed.returncode != 0
    # What transformers' resume-latest picks is the previous checkpoint, complete.
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-2")
    assert _complete(out / "checkpoint-2")
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert (out / STAGING).exists()  # the interrupted save, under a name nothing picks

    resumed = _launch(out, "--zero_stage", "3", "--resume_from_checkpoint", "true")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert not (out / STAGING).exists()
    losses = _losses(out)
    assert [losses[s] for s in (3, 4, 5, 6)] == [uninterrupted[s] for s in (3, 4, 5, 6)]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == [
        "checkpoint-2", "checkpoint-4", "checkpoint-6"
    ]  # fmt: skip


def test_a_full_disk_names_the_folder_and_keeps_the_previous_checkpoint(tmp_path):
    out = tmp_path / "out"
    full = _launch(out, "--zero_stage", "2", fault="enospc@checkpoint-4")
    assert full.returncode != 0
    assert f"no space left on the device while saving a checkpoint under {out}" in full.stderr
    assert "MiB free; the last checkpoint took" in full.stderr
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-2")
    assert _complete(out / "checkpoint-2")
    assert not (out / STAGING).exists()  # the partial save's space is given back at once


def test_a_partitioned_stage3_build_resumes_exactly(tmp_path):
    config = tmp_path / "model"
    tiny_llama(0, vocab_size=len(tiny_tokenizer())).config.save_pretrained(config)
    flags = ["--zero_stage", "3", "--model_config", str(config)]
    whole = _launch(tmp_path / "whole", *flags, recipe="finetune_full")
    assert whole.returncode == 0, whole.stderr[-4000:]
    out = tmp_path / "out"
    checkpoint = tmp_path / "whole" / "checkpoint-2"
    resumed = _launch(
        out, *flags, "--resume_from_checkpoint", str(checkpoint), recipe="finetune_full"
    )
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    expected, losses = _losses(tmp_path / "whole"), _losses(out)
    assert [losses[s] for s in (3, 4, 5, 6)] == [expected[s] for s in (3, 4, 5, 6)]


def _built_differently(change: dict) -> str:
    kwargs = {**MODEL, **(change if dist.get_rank() == 1 else {})}
    model = tiny_llama(0, **kwargs)
    try:
        hf_zero.initialize(model, torch.optim.AdamW(model.parameters()), stage=3)
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"hidden_size": 48}, "rank 0 has 'model.embed_tokens.weight' (251, 40) float32"),
        ({"num_hidden_layers": 3}, "rank 1 has 'model.layers.2.self_attn.q_proj.weight'"),
    ],
    ids=["wider", "one-more-layer"],
)
def test_ranks_that_built_different_models_fail_together_naming_the_difference(change, named):
    for message in run_distributed(_built_differently, 2, args=(change,), timeout=60):
        assert "ranks built different models (ranks [1] differ from rank 0)" in message, message
        assert named in message, message
