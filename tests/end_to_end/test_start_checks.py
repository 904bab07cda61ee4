"""Mistakes found before training, as one ``error:`` line from rank 0 with exit status 2: an
output folder that cannot be written, an NVMe path that names a file, a gradient accumulation
of 0. Each under ``-m hf_zero.run`` on an unmodified Trainer script and in a recipe
(``ZeroTrainingArguments``), launched as the docs say."""

import contextlib
import subprocess
from pathlib import Path

import pytest
from helpers import ROOT, launch

CLM = ["-m", "hf_zero.run", str(ROOT / "recipes/examples/run_clm.py"), "--do_train"]
RECIPE = [str(ROOT / "recipes/finetune_lora.py")]


@pytest.fixture
def read_only_dir(tmp_path):
    """A read-only file system (root writes through permission bits, not through this); where
    mounting is not allowed, sysfs, which takes no new files either."""
    folder = tmp_path / "ro"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)],
                             capture_output=True)  # fmt: skip
    yield folder / "out" if mounted.returncode == 0 else Path("/sys/hf_zero-out")
    if mounted.returncode == 0:
        with contextlib.suppress(OSError):
            subprocess.run(["umount", str(folder)], check=True)


def _launch(args: list[str]) -> subprocess.CompletedProcess:
    return launch(args, check=False)


def _one_error_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr[-3000:]
    assert "[rank0]: Traceback" not in done.stderr and "{'loss'" not in done.stdout
    assert "exitcode  : 2" in done.stderr  # rank 0's status, in the launcher's summary
    return errors[0]


@pytest.mark.parametrize("script", ["hf_zero.run", "recipe"])
def test_an_unwritable_output_dir_is_one_line_before_training(read_only_dir, script):
    cmd = CLM if script == "hf_zero.run" else RECIPE
    done = _launch([*cmd, "--output_dir", str(read_only_dir), "--max_steps", "2"])
    line = _one_error_line(done)
    assert f"--output_dir '{read_only_dir}' is not writable" in line, line


def test_an_nvme_path_naming_a_file_is_one_line_before_training(tmp_path):
    a_file = tmp_path / "swap"
    a_file.write_text("not a folder")
    flags = ["--zero_stage", "3", "--zero_offload_param", "nvme", "--zero_nvme_path", str(a_file)]
    done = _launch([*CLM, "--output_dir", str(tmp_path / "out"), "--max_steps", "2", *flags])
    line = _one_error_line(done)
    assert (
        f"--zero_nvme_path ('offload_param_nvme_path' / 'nvme_path') '{a_file}' is a file" in line
    )


def test_no_gradient_accumulation_is_one_line_before_training(tmp_path):
    flags = ["--gradient_accumulation_steps", "0", "--zero_stage", "2"]
    done = _launch([*CLM, "--output_dir", str(tmp_path / "out"), "--max_steps", "2", *flags])
    line = _one_error_line(done)
    assert "--gradient_accumulation_steps 0 is not allowed: at least 1" in line, line
