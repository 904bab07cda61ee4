"""Step time of a small CPU run under ``host_memory: release`` (trimming every step, and as it
runs: only steps that leave `TRIM_MIN_BYTES` free) against ``reuse``.

    python benchmarks/bench_host_memory.py [--rounds 3] [--steps 60]

2 CPU ranks, the tiny Llama of `hf_zero.tiny` (32 tokens x 2 a rank and step), AdamW; for each
of stage 2 fp32, stage 3 fp32 and stage 3 bf16, the three settings run one after the other in
every round (fresh ranks each; "trim every step" is ``release`` with the threshold set to 0).
Each run warms up for 5 steps, then times ``--steps``; the table gives the median milliseconds
per step over rounds, each as a ratio to ``reuse``, and the heap's free bytes after the last
step (glibc's ``mallinfo2``), which decide whether ``release`` trims
(`hf_zero.storage.host_memory.TRIM_MIN_BYTES`). Writes
``benchmarks/results/host_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import hf_zero
from hf_zero.storage import host_memory
from hf_zero.storage.host_memory import free_heap_bytes
from hf_zero.testing import run_distributed
from hf_zero.tiny import tiny_llama, token_batches

ROOT = Path(__file__).resolve().parents[1]
CASES = {"stage 2 fp32": (2, "fp32"), "stage 3 fp32": (3, "fp32"), "stage 3 bf16": (3, "bf16")}
SETTINGS = {  # name: host_memory, the trim threshold (None: hf_zero's)
    "trim every step": ("release", 0),
    "release": ("release", None),
    "reuse": ("reuse", None),
}


def _run(stage: int, precision: str, name: str, steps: int) -> tuple[float, int | None]:
    setting, threshold = SETTINGS[name]
    if threshold is not None:
        host_memory.TRIM_MIN_BYTES = threshold  # these forked ranks only
    model = tiny_llama(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = hf_zero.initialize(
        model, optimizer, stage=stage, precision=precision, host_memory=setting
    )
    batches = token_batches(32, 2, dist.get_rank(), dist.get_world_size(), seed=0)
    for step in range(5 + steps):
        if step == 5:
            start = time.perf_counter()
        x = next(batches)
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
    return (time.perf_counter() - start) / steps, free_heap_bytes()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    times: dict = {(c, s): [] for c in CASES for s in SETTINGS}
    free: dict = {}
    for _ in range(args.rounds):
        for case, (stage, precision) in CASES.items():
            for name in SETTINGS:
                seconds, heap = run_distributed(_run, 2, (stage, precision, name, args.steps))[0]
                times[case, name].append(seconds)
                free[case, name] = heap
    rows = []
    print(f"| run | {' | '.join(f'{n} ms/step' for n in SETTINGS)} | heap free after (MiB) |")
    print("|---|" + "---:|" * (len(SETTINGS) + 1))
    for case in CASES:
        ms = {n: statistics.median(times[case, n]) * 1e3 for n in SETTINGS}
        cells = [f"{ms[n]:.1f} ({ms[n] / ms['reuse']:.2f}x)" for n in SETTINGS]
        heap = free[case, "release"]
        shown = "?" if heap is None else f"{heap / 2**20:.1f}"
        print(f"| {case} | {' | '.join(cells)} | {shown} |")
        rows.append({"run": case, "ms_per_step": ms, "heap_free": heap})
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "host_memory.json").write_text(json.dumps({"rounds": args.rounds, "rows": rows}))


if __name__ == "__main__":
    main()
