"""The GPU lane's driver: run every check, time it, write one JSON and a text summary.

Started by ``scripts/gpu_check.sh`` (``make gpu-check``) once it has found a GPU and a Python whose
torch sees it; see docs/GPU.md. Checks, in order (each its own process, with a time limit):

1. ``tests/gpu/test_gpu_lane.py`` with ``HF_ZERO_TEST_DEVICE=cuda``: stages 0-3 (fp32, bf16),
   offload (stages 1-3), ZeRO++, MixZ++, the quantizer, a checkpoint round trip with the CUDA RNG;
   one rank, NCCL, ``cuda:0``. Per test: outcome, seconds, peak ``torch.cuda.max_memory_allocated``.
2. The multi-rank parity tests, 2 ranks on CPU with gloo (``CUDA_VISIBLE_DEVICES=""``): NCCL
   refuses two ranks on one GPU, and gloo moves CUDA tensors only for some collectives (not the
   point-to-point sends hf_zero's gloo exchanges use), so these stay the CPU path they are in CI.
3. ``make train`` with ``configs/accelerate/gpu_1proc_bf16.yaml``.
4. ``benchmarks/bench_gpu_offload.py``: a ~1B-parameter step, hf_zero vs DeepSpeed vs FSDP2.

Exit status 1 if any check failed; the summary says which.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MULTI_RANK = [
    "tests/sharding/test_parity.py",
    "tests/sharding/stage3/test_stage3.py",
    "tests/sharding/test_offload.py",
    "tests/sharding/test_zeropp.py",
    "tests/sharding/test_mixz.py",
    "tests/checkpoint/test_checkpoint.py",
]


@dataclass
class Check:
    name: str
    cmd: list[str]
    timeout: int
    env: dict[str, str] = field(default_factory=dict)
    junit: str | None = None


def checks(python: str, venv: str, out: Path, quick: bool) -> list[Check]:
    pytest = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    parallel = ["-n", "8"] if importlib.util.find_spec("xdist") else []
    steps = [
        Check(
            "gpu tests (1 rank, NCCL, cuda:0)",
            [*pytest, "tests/gpu/test_gpu_lane.py", f"--junitxml={out / 'gpu_tests.xml'}"],
            timeout=240,
            env={"HF_ZERO_TEST_DEVICE": "cuda", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"},
            junit="gpu_tests.xml",
        ),
        Check(
            "multi-rank tests (2 ranks, gloo, CPU)",
            [
                *pytest,
                *MULTI_RANK,
                *parallel,
                "-m",
                "not slow",
                f"--junitxml={out / 'multi_rank.xml'}",
            ],
            timeout=240,
            env={"CUDA_VISIBLE_DEVICES": ""},
            junit="multi_rank.xml",
        ),
        Check(
            "make train (gpu_1proc_bf16)",
            [
                "make",
                "train",
                "ACCELERATE_CONFIG=configs/accelerate/gpu_1proc_bf16.yaml",
                f"VENV={venv}",
                "TRAIN_OUT=outputs/gpu-check-train",
            ],
            timeout=150,
        ),
    ]
    if not quick:
        steps.append(
            Check(
                "timings: ~1B step, ZeRO-3 + CPU optimizer offload",
                [python, "benchmarks/bench_gpu_offload.py", "--out", str(out)],
                timeout=240,
            )
        )
    return steps


def run(check: Check, index: int, out: Path) -> dict:
    log = out / f"check{index}.log"
    start = time.monotonic()
    with log.open("w") as f:
        try:
            done = subprocess.run(
                check.cmd,
                cwd=ROOT,
                env={**os.environ, **check.env},
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=check.timeout,
            )
            status = "passed" if done.returncode == 0 else f"failed (exit {done.returncode})"
        except subprocess.TimeoutExpired:
            status = f"failed (over its {check.timeout} s limit)"
    result = {
        "name": check.name,
        "command": " ".join(check.cmd),
        "env": check.env,
        "status": status,
        "seconds": round(time.monotonic() - start, 1),
        "log": log.name,
    }
    if check.junit and (out / check.junit).exists():
        result["tests"] = junit_tests(out / check.junit)
    return result


def junit_tests(path: Path) -> list[dict]:
    """Per test: name, outcome, seconds, and the ``peak_cuda_bytes`` property when recorded."""
    tests = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        peak = props.get("peak_cuda_bytes")
        tests.append(
            {
                "name": f"{case.get('classname', '')}::{case.get('name')}",
                "outcome": outcome,
                "seconds": float(case.get("time", 0)),
                "peak_cuda_bytes": int(peak) if peak is not None else None,
            }
        )
    return tests


def machine() -> dict:
    import torch

    info = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    )
    info["commit"] = commit.stdout.strip() or "unknown"
    info["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return info


def summary(report: dict) -> str:
    m = report["machine"]
    lines = [
        f"hf_zero GPU lane, {m['date']}, commit {m['commit']}: {m.get('gpu', 'no GPU')}, "
        f"torch {m['torch']} (CUDA {m['cuda']})",
        f"RESULT: {'PASSED' if report['passed'] else 'FAILED'} in {report['seconds']:.0f} s",
    ]
    for step in report["checks"]:
        lines.append(f"- {step['name']}: {step['status']} ({step['seconds']:.0f} s, {step['log']})")
        for t in step.get("tests", []):
            if t["outcome"] != "passed" or t["peak_cuda_bytes"]:
                peak = t["peak_cuda_bytes"]
                peak_text = f", peak {peak / 2**20:.0f} MiB" if peak else ""
                lines.append(f"    {t['outcome']:7s} {t['name']} ({t['seconds']:.1f} s{peak_text})")
    table = report.get("timings_table")
    if table:
        lines += ["", table]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", default=".venv-gpu", help="the venv `make train` runs in")
    parser.add_argument("--out", default="results/gpu-check", help="results folder")
    parser.add_argument("--quick", action="store_true", help="skip the ~1B timing run")
    args = parser.parse_args(argv)
    out = (ROOT / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    report = {"machine": machine(), "checks": []}
    for index, check in enumerate(checks(sys.executable, args.venv, out, args.quick), 1):
        print(f"gpu-check: {check.name} ...", flush=True)
        step = run(check, index, out)
        print(f"gpu-check: {check.name}: {step['status']} ({step['seconds']:.0f} s)", flush=True)
        report["checks"].append(step)
    timings = out / "bench_gpu_offload.json"
    if timings.exists():
        data = json.loads(timings.read_text())
        report["timings"], report["timings_table"] = data, data.get("table")
    report["passed"] = all(step["status"] == "passed" for step in report["checks"])
    report["seconds"] = round(time.monotonic() - start, 1)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    text = summary(report)
    (out / "summary.txt").write_text(text)
    print(text, end="")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
