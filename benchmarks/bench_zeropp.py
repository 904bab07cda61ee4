"""ZeRO++ combinations side by side: bytes per step across and inside nodes, time, loss, memory.

    torchrun --nproc_per_node 4 benchmarks/bench_zeropp.py --node_size 2 [--steps 30]

Every combination of qwZ / hpZ / qgZ on stage 3 trains the same model from the same seeds on the
same batches, in one run, interleaved round-robin over ``--repeats`` rounds. ``--node_size``
simulates nodes on one machine (leave it out on a real cluster: LOCAL_WORLD_SIZE is used).
Rank 0 prints a table with ratios to plain ZeRO-3 and writes JSON (and a PNG where matplotlib
imports) to ``--out``. Bytes follow hf_zero's CommStats convention (the ZeRO paper's volume).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import hf_zero
from hf_zero.comm.topology import init_distributed
from hf_zero.tiny import tiny_llama, token_batches

PARTS = ("quantized_weights", "hpz", "quantized_gradients")
SHORT = {"quantized_weights": "qwZ", "hpz": "hpZ", "quantized_gradients": "qgZ"}


def combinations(hpz: int) -> dict[str, dict]:
    out = {}
    for on in itertools.product([False, True], repeat=3):
        flags = dict(zip(PARTS, on))
        name = "+".join(SHORT[p] for p in PARTS if flags[p]) or "ZeRO-3"
        out[name] = {
            "quantized_weights": flags["quantized_weights"],
            "hpz_partition_size": hpz if flags["hpz"] else 1,
            "quantized_gradients": flags["quantized_gradients"],
        }
    return out


def run(cfg: dict, args, rank: int, world: int) -> dict:
    model = tiny_llama(0, hidden_size=args.hidden, intermediate_size=2 * args.hidden)
    engine = hf_zero.initialize(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        stage=3,
        precision=args.precision,
        node_size=args.node_size,
        **cfg,
    )
    batches = token_batches(args.seq_len, args.batch_size, rank, world, seed=0)
    times, losses, secondary = [], [], 0
    for _ in range(args.steps):
        x = next(batches)
        start = time.perf_counter()
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        secondary = max(secondary, engine.memory_report()["secondary_params"])
        engine.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    stats = engine.comm_stats
    return {
        "step_s": statistics.median(times[1:]),
        "inter_node_bytes": sum(stats.inter_node_bytes.values()) / args.steps,
        "intra_node_bytes": sum(stats.intra_node_bytes.values()) / args.steps,
        "final_loss": sum(losses[-5:]) / 5,
        "secondary_params_bytes": secondary,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--node_size", type=int, default=None)
    parser.add_argument("--hpz", type=int, default=None, help="default: ranks per node")
    parser.add_argument("--precision", default="bf16", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seq_len", type=int, default=64)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/zeropp")
    args = parser.parse_args()

    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    node = args.node_size or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    results: dict[str, list[dict]] = {}
    combos = combinations(args.hpz or node)
    for _ in range(args.repeats):
        for name, cfg in combos.items():
            results.setdefault(name, []).append(run(cfg, args, rank, world))
    if rank != 0:
        return
    rows = {}
    for name, runs in results.items():
        rows[name] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    base = rows["ZeRO-3"]
    print(
        f"\nZeRO++ on {world} ranks as {world // node} nodes x {node}, {args.precision}, "
        f"hidden {args.hidden}, {args.steps} steps x {args.repeats} rounds\n"
    )
    header = (
        "| mode | inter-node MB/step | vs ZeRO-3 | intra-node MB/step | step (ms) | vs ZeRO-3 "
        "| final loss | vs ZeRO-3 | secondary MB |"
    )
    print(header)
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['inter_node_bytes'] / 1e6:.3f} "
            f"| {r['inter_node_bytes'] / base['inter_node_bytes']:.2f}x "
            f"| {r['intra_node_bytes'] / 1e6:.3f} | {r['step_s'] * 1e3:.1f} "
            f"| {r['step_s'] / base['step_s']:.2f}x | {r['final_loss']:.4f} "
            f"| {(r['final_loss'] - base['final_loss']) / base['final_loss']:+.2%} "
            f"| {r['secondary_params_bytes'] / 1e6:.3f} |"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "zeropp.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(8, 3.5))
    names = list(rows)
    ax.bar(names, [rows[n]["inter_node_bytes"] / base["inter_node_bytes"] for n in names])
    ax.axhline(0.3, color="gray", linestyle="--", label="0.3x target")
    ax.set_ylabel("inter-node bytes vs ZeRO-3")
    ax.tick_params(axis="x", rotation=30)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "zeropp.png", dpi=120)


if __name__ == "__main__":
    main()
