"""The shipped example scripts (recipes/examples/, plain transformers and TRL: no hf_zero import)
run under ``accelerate launch ... -m hf_zero.run`` at stage 3 exactly as under plain DDP
(``--use_cpu``), as docs/RUNNING.md launches them, 2 CPU ranks, fp32 (``--bf16 false``).

What stage 3 has to get right here: generation entered below the root module (T5's encoder
called by ``generate()``, a PEFT model's ``generate()``), ranks that stop generating at different
lengths, and reference models sharded for evaluation (TRL prepares them with
``evaluation_mode=True``).
"""

import json
from pathlib import Path

import pytest
from helpers import ROOT, assert_reference_run_finished, launch

EXAMPLES = ROOT / "recipes" / "examples"
COMMON = ["--report_to", "none", "--save_strategy", "no", "--logging_steps", "1"]


def _run(script: str, out: Path, args: list[str], zero_stage: int | None) -> str:
    """Launch ``script`` as the docs do; plain DDP when ``zero_stage`` is None."""
    hf_zero = ["-m", "hf_zero.run"] if zero_stage is not None else []
    tail = ["--zero_stage", str(zero_stage)] if zero_stage is not None else ["--use_cpu", "true"]
    cmd = [*hf_zero, str(EXAMPLES / script), "--output_dir", str(out), *COMMON, *args, *tail]
    done = launch(cmd, check=zero_stage is not None)
    if zero_stage is None:
        assert_reference_run_finished(done, _trained(out))
    return done.stderr


def _trained(out: Path) -> bool:
    """Whether the run saved its state after training (``train()`` ends in collectives, so every
    rank got there)."""
    state = out / "trainer_state.json"
    return state.exists() and "train_runtime" in state.read_text()


def _logged(out: Path, *keys: str) -> list[tuple]:
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return [tuple(row[k] for k in keys) for row in history if "loss" in row]


def test_seq2seq_predict_with_generate_at_stage3_equals_stage2(tmp_path):
    """``Seq2SeqTrainer --predict_with_generate`` on T5: ``generate()`` calls the encoder
    directly, below the root module that owns the shared embedding."""
    args = ["--do_train", "--do_predict", "--predict_with_generate", "--max_steps", "30",
            "--learning_rate", "3e-3", "--per_device_train_batch_size", "8",
            "--per_device_eval_batch_size", "4"]  # fmt: skip
    predictions = {}
    for stage in (2, 3):
        out = tmp_path / f"zero{stage}"
        _run("run_summarization.py", out, args, stage)
        predictions[stage] = (out / "generated_predictions.txt").read_text().splitlines()
    assert len(predictions[3]) == 16 and predictions[3] == predictions[2], predictions
    assert sum(line in ("the cat", "a dog", "my friend") for line in predictions[3]) >= 4


GRPO = ["--beta", "0.04", "--max_steps", "4", "--per_device_train_batch_size", "4",
        "--num_generations", "4", "--max_completion_length", "12", "--bf16", "false",
        "--learning_rate", "1e-2"]  # fmt: skip


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full-with-reference-model"])
def test_trl_grpo_at_stage3_equals_ddp(lora, tmp_path):
    """GRPO samples completions with ``generate()`` every step (a PEFT model's generate enters
    the base model below the root; completions end at different lengths on the two ranks) and,
    with ``--beta``, scores them under a reference: LoRA's disabled adapters, or a separate
    model that stage 3 shards for evaluation."""
    args = [*GRPO, *(["--use_peft"] if lora else [])]
    keys = ("loss", "reward", "kl", "completions/mean_length")
    ddp = _run("grpo.py", tmp_path / "ddp", args, None)
    zero = _run("grpo.py", tmp_path / "zero3", args, 3)
    expected, got = _logged(tmp_path / "ddp", *keys), _logged(tmp_path / "zero3", *keys)
    assert len(got) == 4 and got[-1][2] > 0, got  # the policy moved away from the reference
    for a, b in zip(got, expected):
        assert a[1] == b[1] and a[3] == b[3], (got, expected)  # the same completions sampled
        assert abs(a[0] - b[0]) < 1e-5 and abs(a[2] - b[2]) < 1e-5, (got, expected)
    assert ("evaluation only" in zero) != lora and "hf_zero" not in ddp


def test_trl_dpo_full_with_a_sharded_reference_model_equals_ddp(tmp_path):
    args = ["--max_steps", "4", "--per_device_train_batch_size", "4", "--bf16", "false",
            "--learning_rate", "1e-3"]  # fmt: skip
    keys = ("loss", "rewards/margins")
    _run("dpo.py", tmp_path / "ddp", args, None)
    zero = _run("dpo.py", tmp_path / "zero3", args, 3)
    expected, got = _logged(tmp_path / "ddp", *keys), _logged(tmp_path / "zero3", *keys)
    assert len(got) == 4 and got[-1][0] < got[0][0], got
    for a, b in zip(got, expected):
        assert abs(a[0] - b[0]) < 1e-5 and abs(a[1] - b[1]) < 1e-5, (got, expected)
    # The reference model got an engine of its own: sharded, no optimizer.
    assert "evaluation only (no trainable parameters)" in zero
