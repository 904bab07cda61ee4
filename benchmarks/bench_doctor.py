"""The doctor's predictions against runs: each recommended change applied, its peak memory and
step time measured, next to what the doctor predicted from the unchanged run.

    python benchmarks/bench_doctor.py [--rounds 3]

2 CPU ranks, the 19M-parameter Llama of tests/doctor/test_doctor.py at stage 0 (batch 8 x 128,
fp32). Each round profiles the unchanged run and every change in fresh processes, in that order (the
offloads are predicted from stage 2 / stage 3 runs, MixZ++ from a stage-3 LoRA run); the table
shows medians over rounds: measured / predicted peak (VmHWM) and step time, and whether the step
time moved the way the doctor said. Writes ``benchmarks/results/doctor.json``.
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
CASES = {  # stage, micro-batch, accumulation, activation checkpointing, more settings
    "base": (0, 8, 1, False, {}),
    "stage 1": (1, 8, 1, False, {}),
    "stage 2": (2, 8, 1, False, {}),
    "stage 3": (3, 8, 1, False, {}),
    "micro-batch": (0, 4, 2, False, {}),
    "checkpointing": (0, 8, 1, True, {}),
    "tp": (0, 8, 2, False, {"tp_size": 2}),
    "offload_optimizer": (2, 8, 1, False, {"offload_optimizer": "cpu"}),
    "offload_param": (3, 8, 1, False, {"offload_param": "cpu"}),
    "lora": (3, 8, 1, False, {"lora": True}),
    "mixz": (3, 8, 1, False, {"lora": True, "quantized_nontrainable_weights": True}),
}
PREDICTED_FROM = {"offload_optimizer": "stage 2", "offload_param": "stage 3", "mixz": "lora"}
"""The run each change is predicted from (the others: "base")."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default=None, help="comma-separated changes (and their sources)")
    args = parser.parse_args()
    names = list(CASES)
    if args.only:
        wanted = set(args.only.split(","))
        wanted |= {PREDICTED_FROM.get(n, "base") for n in wanted}
        names = [n for n in names if n in wanted]
    rows: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as root:
        for r in range(args.rounds):
            measured = {}
            for name in names:
                *case, settings = CASES[name]
                folder = f"{root}/{r}/{name}"
                run_distributed(
                    profiled_training, 2, args=(folder, *case, 3), kwargs=settings, timeout=600
                )
                measured[name] = diagnose(load_profiles(folder))
            for name, d in measured.items():
                if name in ("base", "lora"):
                    continue
                source = measured[PREDICTED_FROM.get(name, "base")]
                c = {c.kind: c for c in recommend(source)}[name]
                row = rows.setdefault(name, {"peak": [], "step": [], "moved": [], "said": []})
                row["peak"].append(d.os_peak_bytes / c.peak_bytes)
                row["step"].append(d.step_s / c.step_s)
                row["moved"].append(d.step_s / source.step_s)
                row["said"].append(c.step_s / source.step_s)
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
