"""The GPU lane's CPU-side parts: `make gpu-check` without a GPU, the driver's report, and the
timing benchmark's code path (on CPU, where its timings mean nothing).

The lane's tests themselves (tests/gpu/test_gpu_lane.py) run in this suite on one CPU rank.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers import ROOT

sys.path.insert(0, str(ROOT / "scripts"))

import gpu_check


def test_make_gpu_check_without_a_gpu_says_so_in_one_line_and_runs_nothing(tmp_path):
    venv, results = tmp_path / "venv", tmp_path / "results"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", GPU_VENV=str(venv), GPU_RESULTS=str(results))
    done = subprocess.run(
        ["make", "-s", "gpu-check"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-check: no GPU visible"), done.stdout
    assert "nothing run" in lines[0]
    assert not venv.exists() and not results.exists()


def test_without_nvidia_smi_it_is_the_same_answer(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}  # nothing of CUDA on the path
    if any(Path(d, "nvidia-smi").exists() for d in env["PATH"].split(":")):
        env["CUDA_VISIBLE_DEVICES"] = ""  # a GPU machine: keep the test from starting the lane
    done = subprocess.run(
        ["bash", "scripts/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0 and "nothing run" in done.stdout, done
    assert len(done.stdout.strip().splitlines()) == 1


def test_report_reads_junit_and_fails_on_any_failure(tmp_path):
    junit = tmp_path / "t.xml"
    junit.write_text(
        '<testsuites><testsuite name="s">'
        '<testcase classname="tests.test_gpu_lane" name="test_a" time="1.5">'
        '<properties><property name="peak_cuda_bytes" value="2097152"/></properties>'
        "</testcase>"
        '<testcase classname="tests.test_gpu_lane" name="test_b" time="0.1">'
        '<failure message="boom"/></testcase>'
        "</testsuite></testsuites>"
    )
    tests = gpu_check.junit_tests(junit)
    assert tests[0] == {
        "name": "tests.test_gpu_lane::test_a",
        "outcome": "passed",
        "seconds": 1.5,
        "peak_cuda_bytes": 2097152,
    }
    assert tests[1]["outcome"] == "failed" and tests[1]["peak_cuda_bytes"] is None
    failing = gpu_check.Check("false", ["false"], timeout=10)
    step = gpu_check.run(failing, 1, tmp_path)
    assert step["status"] == "failed (exit 1)" and (tmp_path / "check1.log").exists()
    report = {
        "machine": {"date": "d", "commit": "c", "torch": "t", "cuda": None},
        "checks": [step | {"tests": tests}],
        "passed": False,
        "seconds": 1.0,
    }
    text = gpu_check.summary(report)
    assert "RESULT: FAILED" in text and "failed  tests.test_gpu_lane::test_b" in text
    assert "peak 2 MiB" in text


def test_timing_benchmark_runs_its_systems_on_cpu(tmp_path):
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "bench_gpu_offload.py"),
        "--out",
        str(tmp_path),
    ]
    cmd += ["--hidden", "64", "--layers", "2", "--seq_len", "16", "--batch_size", "1"]
    cmd += ["--steps", "2", "--warmup", "1", "--only", "hf_zero"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads((tmp_path / "bench_gpu_offload.json").read_text())
    rows = report["rows"]
    assert set(rows) == {"hf_zero", "hf_zero (no copy-back overlap)"}
    for row in rows.values():
        assert "skipped" not in row and row["step_s"] > 0 and len(row["steps_s"]) == 2
    assert "| hf_zero | " in report["table"] and "1.00x" in report["table"]
