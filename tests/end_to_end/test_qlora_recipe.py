"""QLoRA end to end: `recipes/finetune_lora.py --quantization nf4|int8` under `accelerate launch`
(2 CPU ranks), then the adapter reloaded the ways users reload it.

The trained model's probe logits (computed in the training run, stage 3 gathering the base's
bytes) must equal those of ``PeftModel.from_pretrained`` on a base loaded with the same
``BitsAndBytesConfig``, and of ``hf_zero.load_for_inference``: the same codes and the same
kernels, so the bound is 1e-6 (measured: 0.0). On CPUs with AVX512-BF16, bitsandbytes' eval-mode
inference kernel (which training cannot use, see `hf_zero.numerics.packed`) computes differently: with
it on, PEFT's reload is 0.4% of the logits' norm away (measured; bounded at 2%). The merged export dequantizes the base; its
logits differ from the trained ones by bitsandbytes' dequantize-then-matmul against its fused
kernel and by the merge's rounding (bounded at 2% of the logits' norm).
"""

import json
import sys

import bitsandbytes  # noqa: F401  (a test dependency: missing, fail, never skip)
import pytest
import torch
from helpers import ROOT, launch

import hf_zero
from hf_zero.numerics.packed import disable_cpu_repacking
from hf_zero.tiny import tiny_tokenizer

sys.path.insert(0, str(ROOT / "recipes"))


def _launch(*flags: str, steps: int = 40) -> str:
    args = [str(ROOT / "recipes/finetune_lora.py"), "--max_steps", str(steps)]
    args += ["--learning_rate", "1e-2", "--per_device_train_batch_size", "8"]
    args += ["--logging_steps", "10", "--report_to", "none", "--disable_tqdm", "true", *flags]
    return launch(args).stderr


def _probe(model) -> torch.Tensor:
    from recipe_utils import probe_logits

    return probe_logits(model, tiny_tokenizer(), "cpu")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize(("quant", "stage"), [("nf4", "3"), ("int8", "2")])
def test_qlora_recipe_trains_and_reloads_exactly(tmp_path, quant, stage):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    out, merged = tmp_path / "out", tmp_path / "merged"
    log = _launch(
        "--zero_stage", stage, "--quantization", quant, "--output_dir", str(out),
        "--save_strategy", "no", "--merged_output_dir", str(merged),
    )  # fmt: skip
    assert f"hf_zero: stage {stage} over 2" in log and "MixZ++" not in log
    # Stage 3 loads the base inside partitioned_init: each rank keeps only its slices.
    assert ("from_pretrained inside partitioned_init" in log) == (stage == "3"), log[-3000:]
    losses = [e["loss"] for e in json.loads((out / "log_history.json").read_text()) if "loss" in e]
    assert losses[-1] < 0.8 * losses[0], losses
    trained = torch.load(out / "probe_logits.pt")
    record = json.loads((out / "hf_zero_training.json").read_text())
    config = BitsAndBytesConfig.from_dict(record["bitsandbytes"]["quantization_config"])
    assert config.load_in_4bit == (quant == "nf4")

    # PEFT's own reload, on a base loaded the way the run loaded it.
    base_dir = json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]

    def reload():
        base = AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=config)
        return PeftModel.from_pretrained(base, out)

    fast = _probe(reload())  # bitsandbytes' own CPU inference kernel where the CPU has one
    assert _rel(fast, trained) < 0.02, _rel(fast, trained)
    peft = reload()
    disable_cpu_repacking(peft)  # the kernels training computes with: exactly
    assert _rel(_probe(peft), trained) < 1e-6, _rel(_probe(peft), trained)
    # hf_zero's, from the record alone.
    again = hf_zero.load_for_inference(None, out)
    assert _rel(_probe(again), trained) < 1e-6, _rel(_probe(again), trained)
    # The merged export: a plain model, the base dequantized.
    plain = AutoModelForCausalLM.from_pretrained(merged)
    assert "quantization_config" not in json.loads((merged / "config.json").read_text())
    assert all(type(p) is torch.nn.Parameter for p in plain.parameters())
    assert _rel(_probe(plain), trained) < 0.02, _rel(_probe(plain), trained)


def test_qlora_recipe_resumes_exactly(tmp_path):
    """Stage 3 over an NF4 base given by path (loaded straight into each rank's slices, no
    16-bit copy first), checkpoints every 10 steps; a second run resumed from checkpoint-10
    logs the same losses for steps 15 and 20 as the uninterrupted run."""
    from recipe_utils import load_model_and_tokenizer

    base = tmp_path / "base"
    model, tokenizer = load_model_and_tokenizer(None, seed=0)
    model.save_pretrained(base)
    tokenizer.save_pretrained(base)
    out = tmp_path / "out"
    flags = ["--zero_stage", "3", "--quantization", "nf4", "--output_dir", str(out)]
    flags += ["--model_name_or_path", str(base)]
    flags += ["--save_strategy", "steps", "--save_steps", "10", "--logging_steps", "5"]
    log = _launch(*flags, steps=20)
    assert "from_pretrained inside partitioned_init" in log, log[-3000:]
    assert not (out / "base_model").exists()  # the base is the given path, not a copy
    history = json.loads((out / "log_history.json").read_text())
    full = {e["step"]: e["loss"] for e in history if "loss" in e}
    _launch(*flags, "--resume_from_checkpoint", str(out / "checkpoint-10"), steps=20)
    history = json.loads((out / "log_history.json").read_text())
    resumed = {e["step"]: e["loss"] for e in history if "loss" in e}
    assert set(full) == {5, 10, 15, 20}, full
    assert [resumed[s] for s in (15, 20)] == [full[s] for s in (15, 20)], (full, resumed)
