"""ZeRO-Infinity's step time against the host memory it is given, beside DeepSpeed's.

    OMP_NUM_THREADS=1 PYTHONPATH=/work/dslib python benchmarks/bench_infinity_budget.py \
        --hidden 1024 --layers 24 --deepspeed

Each point is one `benchmarks/bench_infinity.py` run (a fresh group of ranks living a whole run:
partitioned build, ``--steps`` steps, an evaluation forward, the streamed save; peak RSS per
rank from process start). hf_zero's ``nvme``/``nvme`` runs at host budgets given as fractions
of the bytes it could keep in memory per rank: 4 per parameter-shard element (the fp32 shard,
``offload_param_max_in_cpu``) and 16 per optimizer element (master, gradient, two Adam moments,
``offload_optimizer_max_in_cpu``). A budget fills the parameter cache first (its bytes are read
twice a step), then the optimizer's. hf_zero's ``cpu``/``cpu`` and, with ``--deepspeed``,
DeepSpeed 0.19.8's ``cpu``/``cpu`` and ``nvme``/``nvme`` (its defaults: ``max_in_cpu`` 1e9,
``stage3_max_reuse_distance`` 1e9) are the reference points; hf_zero's ``cpu``/``cpu`` runs at
each ``--cpu_reuse`` (its ``max_reuse_distance``: 0, its default, and DeepSpeed's 1e9, which
keeps the gathered units from forward to backward). Prints a table with each point's
step time and peak as ratios to DeepSpeed's ``nvme``/``nvme``, writes
``--out/bench_infinity_budget.json`` and a plot of step time against peak RSS
(``--out/infinity_budget.png``). Timings are never asserted anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
NVME = "Infinity nvme/nvme"


def shard_numel(args) -> int:
    """Each rank's share of the model's parameters (the host budget's scale)."""
    import torch
    from common import llama_shape
    from transformers import LlamaForCausalLM

    from hf_zero.tiny import tiny_llama_config

    config = tiny_llama_config(**llama_shape(args.hidden, args.layers, args.vocab, args.seq_len))
    with torch.device("meta"):
        params = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    return params // args.nproc


def run_point(args, label: str, extra: list[str]) -> dict[str, dict]:
    """One bench_infinity run; its summary rows by configuration name."""
    out = Path(args.out) / "budget" / label.replace(" ", "_").replace("/", "-")
    cmd = [sys.executable, str(HERE / "bench_infinity.py"), "--out", str(out)]
    for key in ("hidden", "layers", "vocab", "seq_len", "steps", "nproc", "nvme_path"):
        cmd += [f"--{key}", str(getattr(args, key))]
    cmd += ["--bw_gib", str(args.bw_gib), "--reduce_bucket_size", "auto", *extra]
    print(f"running {label} ...", file=sys.stderr, flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    if done.returncode != 0:
        raise RuntimeError(f"{label} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return json.loads((out / "bench_infinity.json").read_text())["summary"]["rows"]


def split(fraction: float, shard: int) -> tuple[int, int]:
    """Elements of parameter cache and of optimizer cache that ``fraction`` of the host-cacheable
    bytes buys (4 and 16 per element; parameters first)."""
    budget = fraction * 20 * shard
    params = int(min(shard, budget / 4))
    return params, int(max(0.0, budget - 4 * params) / 16)


def collect(args) -> list[dict]:
    shard = shard_numel(args)
    points = []
    for fraction in args.fractions:
        params, optimizer = split(fraction, shard)
        extra = ["--only", NVME, "--max_in_cpu", str(params)]
        extra += ["--optimizer_max_in_cpu", str(optimizer)]
        rows = run_point(args, f"budget {fraction:g}", extra)
        name = f"hf_zero nvme/nvme, host budget {fraction:.0%}"
        points.append({"name": name, "param_cache": params, "optimizer_cache": optimizer})
        points[-1].update(rows[NVME])
    for i, reuse in enumerate(args.cpu_reuse):
        extra = ["--only", "stage 3 + offload cpu/cpu", "--max_reuse_distance", str(reuse)]
        extra += ["--deepspeed"] if args.deepspeed and i == 0 else []
        rows = run_point(args, f"cpu reuse {reuse:g}", extra)
        for name, row in rows.items():
            label = "hf_zero cpu/cpu" + (f", max_reuse_distance {reuse:g}" if reuse else "")
            points.append({"name": label if name.startswith("stage 3") else name, **row})
    return points


def table(points: list[dict]) -> str:
    ds = next((p for p in points if p["name"] == "DeepSpeed nvme/nvme"), None)
    lines = [
        "| point | step (s) | peak RSS (MB) | step / DeepSpeed nvme | peak / DeepSpeed nvme "
        "| optimizer step (s) | disk bound / optimizer step | final loss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in points:
        step = f"{p['step_s'] / ds['step_s']:.2f}x" if ds else ""
        peak = f"{p['peak_rss_mb'] / ds['peak_rss_mb']:.2f}x" if ds else ""
        bound = f"{p['bound_fraction']:.2f}" if "bound_fraction" in p else ""
        lines.append(
            f"| {p['name']} | {p['step_s']:.2f} | {p['peak_rss_mb']:.0f} | {step} | {peak} "
            f"| {p['optimizer_step_s']:.2f} | {bound} | {p['final_loss']:.4f} |"
        )
    return "\n".join(lines)


def plot(points: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    curve = [p for p in points if p["name"].startswith("hf_zero nvme")]
    ax.plot(
        [p["peak_rss_mb"] for p in curve], [p["step_s"] for p in curve], "o-",
        label="hf_zero nvme/nvme, host budget 0% .. 100%",
    )  # fmt: skip
    for p in points:
        if p in curve:
            continue
        marker = "s" if p["name"].startswith("DeepSpeed") else "^"
        ax.plot(p["peak_rss_mb"], p["step_s"], marker, label=p["name"])
    ax.set_xlabel("peak RSS per rank over the whole run (MB)")
    ax.set_ylabel("step time (s)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq_len", type=int, default=32)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--fractions", type=float, nargs="+", default=[0.0, 0.1, 0.2, 0.4, 0.6, 1.0])
    p.add_argument(
        "--cpu_reuse",
        type=float,
        nargs="+",
        default=[0.0, 1e9],
        help="hf_zero cpu/cpu points at these max_reuse_distance values (DeepSpeed's default 1e9)",
    )
    p.add_argument("--nvme_path", default="/tmp/hf_zero_bench_nvme")
    p.add_argument("--bw_gib", type=float, default=1.0)
    p.add_argument("--deepspeed", action="store_true", help="add DeepSpeed 0.19.8's points")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    sys.path.insert(0, str(HERE))
    points = collect(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_infinity_budget.json").write_text(json.dumps(points, indent=1))
    plot(points, out / "infinity_budget.png")
    print(table(points))
    print(f"\nwrote {out / 'bench_infinity_budget.json'} and {out / 'infinity_budget.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
