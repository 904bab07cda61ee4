"""A mistake in the arguments or the config is one line, printed once, before any model exists.

Launched as users launch (two CPU processes under ``accelerate launch``): the message appears
exactly once on stderr, no rank prints a traceback, and the exit status is non-zero. What remains
is the launcher's own summary of the failed processes (torchrun's, not ours).
"""

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, launch

LORA = str(ROOT / "recipes/finetune_lora.py")
STOCK = str(ROOT / "tests/scripts/stock_trainer.py")


def _launch(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return launch(args, env={"HF_HUB_OFFLINE": "1", **(env or {})}, check=False)


def _files(tmp_path: Path) -> dict[str, str]:
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("stage: 3\nprecision: [bf16\n")
    typo = tmp_path / "typo.yaml"
    typo.write_text("stage: 3\nreduce_bucket: 100\n")
    return {"bad_yaml": str(bad_yaml), "typo": str(typo), "missing": str(tmp_path / "nope.json")}


CASES = {
    "stage 5": (["--zero_stage", "5"], "'stage' = 5 is not allowed; expected one of 0, 1, 2, 3"),
    "stage three": (["--zero_stage", "three"], "invalid int value: 'three'"),
    "missing file": (["--zero_config", "{missing}"], "nope.json' does not exist"),
    "yaml syntax": (["--zero_config", "{bad_yaml}"], "bad.yaml:3:1: not valid YAML"),
    "typo key": (["--zero_config", "{typo}"], "did you mean 'reduce_bucket_size'?"),
    "tp_size 3 on 2 processes": (["--tp_size", "3"], "'tp_size' = 3 must divide the number"),
    "model path": (["--model_name_or_path", "./no-such-model"], "'./no-such-model' is not a dir"),
    "batch 0": (["--per_device_train_batch_size", "0"], "--per_device_train_batch_size 0 is not"),
}


# Launched on 2 processes: argparse's mistake and one that depends on the launch (a config
# value's, "stage 5", is launched under hf_zero.run below); the others go through the same
# parse_or_exit and run in-process.
LAUNCHED = ["stage three", "tp_size 3 on 2 processes"]


@pytest.mark.parametrize("case", LAUNCHED)
def test_recipe_mistakes_are_one_line_once(tmp_path, case):
    args, message = CASES[case]
    args = [a.format(**_files(tmp_path)) for a in args]
    done = _launch([LORA, "--output_dir", str(tmp_path / "out"), *args])
    assert done.returncode != 0
    assert done.stderr.count(message) == 1, done.stderr[-4000:]
    assert 'finetune_lora.py", line' not in done.stderr, "a rank printed a traceback"
    assert "usage:" not in done.stderr, "argparse's usage dump buries the one line"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", [c for c in CASES if c not in LAUNCHED])
def test_recipe_mistakes_are_one_line_in_one_process(tmp_path, case, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_ZERO_CONFIG", raising=False)
    monkeypatch.syspath_prepend(str(ROOT / "recipes"))
    import finetune_lora

    args, message = CASES[case]
    args = [a.format(**_files(tmp_path)) for a in args]
    with pytest.raises(SystemExit) as stop:
        finetune_lora.main(["--output_dir", str(tmp_path / "out"), *args])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count(message) == 1, err
    assert "Traceback" not in err and "usage:" not in err, err
    assert not (tmp_path / "out").exists()


def test_pipeline_larger_than_the_model_is_one_line_before_the_model_is_built(
    tmp_path, capsys, monkeypatch
):
    """Checked while the arguments are parsed (in one process here: the launched cases above
    show that such a line is printed once)."""
    from hf_zero.tiny import tiny_llama_config

    monkeypatch.delenv("HF_ZERO_CONFIG", raising=False)
    monkeypatch.syspath_prepend(str(ROOT / "recipes"))
    import finetune_full

    tiny_llama_config(num_hidden_layers=1).save_pretrained(tmp_path / "one-layer")
    args = ["--model_config", str(tmp_path / "one-layer"), "--zero_pp_size", "2"]
    with pytest.raises(SystemExit) as stop:
        finetune_full.main(["--output_dir", str(tmp_path / "out"), *args])
    err = capsys.readouterr().err
    message = "--zero_pp_size 2: --model_config '"
    assert stop.value.code == 2 and err.count(message) == 1, err
    assert "has 1 decoder layer(s)" in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def test_rank_zero_reports_even_when_another_rank_fails_first():
    """The other ranks wait for rank 0 to report: the launcher stops every process once one
    exits, and a CI run once lost the message when rank 1 exited before rank 0 had printed."""
    done = _launch([str(ROOT / "tests/scripts/slow_rank0_usage_error.py"), "--zero_stage", "x"])
    assert done.returncode != 0
    assert done.stderr.count("invalid int value: 'x'") == 1, done.stderr[-4000:]


@pytest.mark.parametrize("case", ["stage 5", "yaml syntax", "tp_size 3 on 2 processes"])
def test_hf_zero_run_mistakes_are_one_line_once(tmp_path, case):
    args, message = CASES[case]
    args = [a.format(**_files(tmp_path)) for a in args]
    done = _launch(["-m", "hf_zero.run", STOCK, "--output_dir", str(tmp_path / "out"), *args])
    assert done.returncode != 0
    assert done.stderr.count(message) == 1, done.stderr[-4000:]
    assert "Traceback" not in done.stderr.split("failed (exitcode")[0], done.stderr[-4000:]


def test_hf_zero_config_mistake_under_autoload_is_one_line_once(tmp_path):
    from hf_zero.cli import main as cli

    site_dir = tmp_path / "site"
    site_dir.mkdir()
    (site_dir / "sitecustomize.py").write_text(f"import site\nsite.addsitedir({str(site_dir)!r})\n")
    assert cli(["autoload", "on", "--site-dir", str(site_dir)]) == 0
    env = {"HF_ZERO_CONFIG": _files(tmp_path)["typo"], "PYTHONPATH": str(site_dir)}
    done = _launch([STOCK, "--output_dir", str(tmp_path / "out")], env=env)
    assert done.returncode != 0
    assert done.stderr.count("did you mean 'reduce_bucket_size'?") == 1, done.stderr[-4000:]
    assert "(from HF_ZERO_CONFIG=" in done.stderr


def test_flags_that_reach_no_trainer_or_accelerator_fail_saying_so(tmp_path):
    script = tmp_path / "bare.py"
    script.write_text("print('a script without a Trainer or an Accelerator')\n")
    done = launch(
        ["-m", "hf_zero.run", str(script), "--zero_stage", "3"],
        [sys.executable],
        timeout=120,
        check=False,
    )
    assert done.returncode == 3, done.stderr
    assert "--zero_stage 3 were given, but" in done.stderr and "hf_zero never ran" in done.stderr
    assert "a script without" in done.stdout
    plain = launch(["-m", "hf_zero.run", str(script)], [sys.executable], timeout=120, check=False)
    assert plain.returncode == 0  # no flags: nothing was promised
