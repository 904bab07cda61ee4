"""What profiling costs: step time with ``profile: true`` against the same run without it.

    python benchmarks/bench_profile.py [--rounds 5] [--stages 0 3]

2 CPU ranks, a 19M-parameter Llama (the model of tests/doctor/test_doctor.py), batch 8 x 128 tokens,
fp32. Each round runs the same training twice in fresh processes, profiled and not, in
alternating order; the figure is the median over rounds of (profiled / plain), each side the
median of 6 steps after a warm-up (the slowest rank). Prints a table and writes
``benchmarks/results/profile_overhead.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

import hf_zero
from hf_zero.testing import run_distributed
from hf_zero.tiny import tiny_llama, token_batches

ROOT = Path(__file__).resolve().parents[1]
MODEL = {
    "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 6,
    "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 256,
}  # fmt: skip


def _steps(stage: int, profile: bool, folder: str) -> float:
    import torch.distributed as dist

    model = tiny_llama(0, **MODEL)
    engine = hf_zero.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=stage, profile=profile,
        profile_steps=6, profile_dir=folder,
    )  # fmt: skip
    batches = token_batches(128, 8, dist.get_rank(), dist.get_world_size(), seed=0)
    times = []
    for _ in range(7):
        x = next(batches)
        start = time.perf_counter()
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 3])
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for stage in args.stages:
            ratios, plain, profiled = [], [], []
            for r in range(args.rounds):
                order = (False, True) if r % 2 == 0 else (True, False)
                got = {p: max(run_distributed(_steps, 2, args=(stage, p, folder))) for p in order}
                plain.append(got[False])
                profiled.append(got[True])
                ratios.append(got[True] / got[False])
            results[f"stage {stage}"] = {
                "plain_s": plain, "profiled_s": profiled, "ratios": ratios,
                "median_ratio": statistics.median(ratios),
            }  # fmt: skip
    print(f"| run | plain step | profiled step | profiled / plain (median of {args.rounds}) |")
    print("|---|---:|---:|---:|")
    for name, r in results.items():
        print(
            f"| {name} | {statistics.median(r['plain_s']) * 1000:.0f} ms "
            f"| {statistics.median(r['profiled_s']) * 1000:.0f} ms | {r['median_ratio']:.3f} "
            f"(rounds: {', '.join(f'{x:.2f}' for x in r['ratios'])}) |"
        )
    out = ROOT / "benchmarks" / "results" / "profile_overhead.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
