"""Unmodified Trainer scripts under hf_zero: `python -m hf_zero.run`, HF_ZERO_CONFIG + autoload.

`tests/scripts/stock_trainer.py` imports only torch and transformers (and TRL with ``--trl``).
It reports the Trainer class it got, whether hf_zero was imported, each parameter's visible size
mid-training (0 when ZeRO-3 has released it) and its final logits on a fixed input; the test
loads the saved model with ``from_pretrained`` and checks it reproduces those logits.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_zero.run import split_flags

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "tests" / "scripts" / "stock_trainer.py")
LAUNCH = [sys.executable, "-m", "accelerate.commands.launch"]
CPU_2PROC = str(ROOT / "configs/accelerate/cpu_2proc.yaml")
SHARDED = "model.layers.0.self_attn.q_proj.weight"


def _launch(args: list[str], env: dict | None = None, check: bool = True):
    base = {k: v for k, v in os.environ.items() if k != "HF_ZERO_CONFIG"}
    env = {**base, "OMP_NUM_THREADS": "1", **(env or {})}
    done = subprocess.run(
        [*LAUNCH, "--config_file", CPU_2PROC, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    if check:
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-5000:]
    return done


def _report(out: Path) -> dict:
    report = json.loads((out / "report_rank0.json").read_text())
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(2, 96, (32, 16), generator=torch.Generator().manual_seed(1))[:2]
    with torch.no_grad():
        report["reloaded_diff"] = (
            (model(input_ids=ids).logits - torch.tensor(report["logits"])).abs().max().item()
        )
    return report


@pytest.mark.parametrize(
    "variant", [[], ["--subclass"], ["--trl"]], ids=["Trainer", "subclass", "trl"]
)
def test_unmodified_script_under_hf_zero_run_is_sharded_and_saves_a_loadable_model(
    tmp_path, variant
):
    if variant == ["--trl"]:
        pytest.importorskip("trl")
    out = tmp_path / "out"
    args = ["-m", "hf_zero.run", SCRIPT, *variant, "--output_dir", str(out), "--zero_stage", "3"]
    _launch(args)
    r = _report(out)
    assert "ZeroTrainer" in r["mro"] and r["hf_zero_imported"], r["mro"]
    if variant == ["--subclass"]:
        assert r["mro"][0] == "MyTrainer"
    if variant == ["--trl"]:
        assert r["mro"][0] == "SFTTrainer"
    assert r["sizes"][SHARDED] == 0, "ZeRO-3 releases the layer's weights between steps"
    assert r["reloaded_diff"] < 1e-5, r["reloaded_diff"]


def test_the_same_script_without_hf_zero_is_stock_transformers(tmp_path):
    out = tmp_path / "out"
    _launch([SCRIPT, "--output_dir", str(out)])
    r = _report(out)
    assert r["mro"][:2] == ["Trainer", "object"] and not r["hf_zero_imported"]
    assert r["sizes"][SHARDED] == 64 * 64
    assert r["reloaded_diff"] < 1e-5


def test_hf_zero_config_alone_activates_through_the_autoload_hook(tmp_path):
    from hf_zero.cli import _pth_path
    from hf_zero.cli import main as cli

    out = tmp_path / "out"
    pth = _pth_path(None)
    existed = pth.exists()
    assert cli(["autoload", "on"]) == 0
    try:
        env = {"HF_ZERO_CONFIG": str(ROOT / "configs" / "zero" / "stage3.yaml")}
        _launch([SCRIPT, "--output_dir", str(out)], env=env)
    finally:
        if not existed:
            assert cli(["autoload", "off"]) == 0
    r = _report(out)
    assert "ZeroTrainer" in r["mro"] and r["sizes"][SHARDED] == 0
    assert r["reloaded_diff"] < 1e-5


def test_flags_are_split_from_the_script_arguments():
    values, config, rest = split_flags(
        [
            "--output_dir", "o", "--zero_stage", "3", "--zero_quantized_weights",
            "--zero_hpz_partition_size=auto", "--zero_config", "c.yaml", "--tp_size", "2",
            "--zero_quantized_gradients", "false", "--lr", "1",
        ]
    )  # fmt: skip
    assert rest == ["--output_dir", "o", "--lr", "1"]
    assert config == "c.yaml"
    assert values == {
        "stage": 3,
        "quantized_weights": True,
        "hpz_partition_size": "auto",
        "tp_size": 2,
        "quantized_gradients": False,
    }
    with pytest.raises(ValueError, match="--zero_stage 'three'"):
        split_flags(["--zero_stage", "three"])


def test_bad_settings_fail_before_the_script_runs(tmp_path):
    marker = tmp_path / "ran"
    script = tmp_path / "script.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    done = subprocess.run(
        [sys.executable, "-m", "hf_zero.run", str(script), "--zero_stage", "5"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "'stage' = 5 is not allowed" in done.stderr
    assert not marker.exists()
