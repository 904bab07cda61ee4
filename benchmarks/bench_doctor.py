"""The doctor's predictions against runs: each recommended change applied, its peak memory and
step time measured, next to what the doctor predicted from the unchanged run.

    python benchmarks/bench_doctor.py [--rounds 3]

2 CPU ranks, the 19M-parameter Llama of tests/test_doctor.py at stage 0 (batch 8 x 128, fp32).
Each round profiles the unchanged run and every change in fresh processes, in that order; the
table shows medians over rounds: measured / predicted peak (VmHWM) and step time, and whether
the step time moved the way the doctor said. Writes ``benchmarks/results/doctor.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from hf_zero.doctor.advice import recommend
from hf_zero.doctor.diagnosis import diagnose, load_profiles
from hf_zero.testing import profiled_training, run_distributed

ROOT = Path(__file__).resolve().parents[1]
CASES = {  # stage, micro-batch, accumulation, activation checkpointing
    "base": (0, 8, 1, False),
    "stage 1": (1, 8, 1, False),
    "stage 2": (2, 8, 1, False),
    "stage 3": (3, 8, 1, False),
    "micro-batch": (0, 4, 2, False),
    "checkpointing": (0, 8, 1, True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rows: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as root:
        for r in range(args.rounds):
            measured = {}
            for name, case in CASES.items():
                folder = f"{root}/{r}/{name}"
                run_distributed(profiled_training, 2, args=(folder, *case, 3), timeout=600)
                measured[name] = diagnose(load_profiles(folder))
            base = measured.pop("base")
            predicted = {c.kind: c for c in recommend(base)}
            for name, d in measured.items():
                c = predicted[name]
                row = rows.setdefault(name, {"peak": [], "step": [], "moved": [], "said": []})
                row["peak"].append(d.os_peak_bytes / c.peak_bytes)
                row["step"].append(d.step_s / c.step_s)
                row["moved"].append(d.step_s / base.step_s)
                row["said"].append(c.step_s / base.step_s)
    print(f"| change | measured / predicted peak | measured / predicted step | step vs unchanged: predicted, measured (median of {args.rounds}) |")  # fmt: skip
    print("|---|---:|---:|---|")
    for name, row in rows.items():
        med = {k: statistics.median(v) for k, v in row.items()}
        print(
            f"| {name} | {med['peak']:.3f} | {med['step']:.3f} "
            f"| {med['said']:.2f}x, {med['moved']:.2f}x |"
        )
    out = ROOT / "benchmarks" / "results" / "doctor.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
