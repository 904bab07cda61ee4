"""The README's main job, run as a user runs it: torchrun, two CPU ranks, a saved model."""

import re
import sys

import pytest
import torch
from helpers import ROOT, launch
from transformers import LlamaForCausalLM

from hf_zero.tiny import byte_tokens, tiny_corpus, tiny_llama


def _torchrun(*args: str, timeout: int = 300) -> str:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
    done = launch(
        [str(ROOT / "recipes" / "train_tiny.py"), *args], [*torchrun, "2"], timeout=timeout
    )
    return done.stdout + done.stderr


def _loss(model, tokens):
    with torch.no_grad():
        return model(input_ids=tokens, labels=tokens).loss.item()


@pytest.mark.parametrize(
    "flags",
    [
        ["--zero_stage", "3"],
        ["--zero_stage", "2", "--offload_optimizer", "cpu"],
        ["--zero_config", str(ROOT / "configs/zero/stage1.yaml")],
        ["--zero_config", str(ROOT / "configs/zero/stage2.yaml"), "--precision", "bf16"],
        ["--zero_config", str(ROOT / "configs/zero/ds_zero2.json")],
    ],
    ids=[
        "stage3-flag",
        "stage2-offload",
        "stage1.yaml",
        "stage2.yaml",
        "ds_zero2.json",
    ],
)
def test_train_tiny_learns_and_saves_a_loadable_model(tmp_path, flags):
    out = _torchrun(*flags, "--steps", "40", "--log_every", "10", "--output_dir", str(tmp_path))
    first, last = map(float, re.search(r"loss (\S+) -> (\S+) over 40 steps", out).groups())
    assert last < 0.75 * first, out
    trained = LlamaForCausalLM.from_pretrained(tmp_path)
    tokens = byte_tokens(tiny_corpus())[:256].unsqueeze(0)
    assert _loss(trained, tokens.clone()) < _loss(tiny_llama(seed=0), tokens.clone()) - 1.0


def test_a_flag_that_contradicts_the_config_file_is_reported_naming_both():
    stage2 = str(ROOT / "configs/zero/stage2.yaml")
    args = [str(ROOT / "recipes" / "train_tiny.py"), "--zero_config", stage2, "--precision", "fp32"]
    done = launch(args, [sys.executable], timeout=120, check=False)
    assert done.returncode == 2
    assert "--precision 'fp32' contradicts 'precision' = 'bf16' in" in done.stderr, done.stderr


def test_bad_stage_is_reported_before_training():
    args = [str(ROOT / "recipes" / "train_tiny.py"), "--zero_stage", "5"]
    done = launch(args, [sys.executable], timeout=120, check=False)
    assert done.returncode != 0
    assert "'stage' = 5 is not allowed; expected one of 0, 1, 2, 3" in done.stderr
