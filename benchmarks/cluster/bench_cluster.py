"""ZeRO-3, ZeRO++ and DDP on two simulated nodes over a rate-limited link (run as root).

    python benchmarks/cluster/bench_cluster.py [--rates 200mbit,1gbit,10gbit] [--modes ...]

Builds two network namespaces of 2 ranks each joined by a veth pair shaped with ``tc tbf``
(`simnet`), and for every rate and mode launches the real multi-node path in each namespace:
``torchrun --nnodes 2 --node_rank i --rdzv-endpoint <node 0>:port``; with ``--accelerate``
also once through ``accelerate launch`` with configs/accelerate/two_nodes.yaml. Everything is torn down on exit,
error, timeout or signal. Prints a table per rate (step time and ratio to ZeRO-3, bytes across
the link from the interface counters next to comm_stats' inter-node wire bytes, final loss) and
writes ``cluster.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import simnet  # noqa: E402

MODES = ["ddp", "zero3", "qwz", "hpz", "qgz", "zeropp", "ds_zero3", "ds_zeropp"]
LABELS = {
    "ddp": "torch DDP",
    "zero3": "ZeRO-3",
    "qwz": "qwZ",
    "hpz": "hpZ",
    "qgz": "qgZ",
    "zeropp": "ZeRO++ (all three)",
    "ds_zero3": "DeepSpeed ZeRO-3",
    "ds_zeropp": "DeepSpeed ZeRO++",
    "zero3_accelerate": "ZeRO-3, accelerate YAML",
}

ACCELERATE_YAML = HERE.parents[1] / "configs" / "accelerate" / "two_nodes.yaml"


def torchrun_cmd(
    cluster, node: int, port: int, run_id: str, worker_args: list[str], script: Path | None = None
) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "2", "--nproc_per_node", "2", "--node_rank", str(node),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{cluster.addrs[0]}:{port}",
        "--rdzv-id", run_id, "--local-addr", cluster.addrs[node],
        # torchrun guesses which node hosts the store from the machine's host name; both
        # namespaces share it, so say it.
        "--rdzv-conf", f"is_host={int(node == 0)}",
        str(script or HERE / "cluster_rank.py"), *worker_args, "--link", cluster.links[node],
    ]  # fmt: skip


def accelerate_cmd(cluster, node: int, port: int, worker_args: list[str]) -> list[str]:
    """The repository's two-machine YAML, with this node's rank and node 0's address given on
    the command line, as docs/RUNNING.md says."""
    return [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCELERATE_YAML),
        "--machine_rank", str(node), "--main_process_ip", cluster.addrs[0],
        "--main_process_port", str(port),
        str(HERE / "cluster_rank.py"), *worker_args, "--link", cluster.links[node],
    ]  # fmt: skip


def run_one(cluster, mode: str, args, port: int, launcher: str = "torchrun") -> dict:
    """Launch one mode on both nodes; its row (or the reason it failed)."""
    workdir = Path(tempfile.mkdtemp(prefix=f"hfz-cluster-{mode}-"))
    worker_args = [
        "--mode", mode, "--out", str(workdir), "--steps", str(args.steps),
        "--warmup", str(args.warmup), "--precision", args.precision, "--profile_sort", args.profile_sort,
    ] + (["--trace"] if args.trace else []) + (["--profile"] if args.profile else []) + (
        ["--extra", args.extra] if args.extra and not mode.startswith(("ds_", "ddp")) else []
    )  # fmt: skip
    if launcher == "torchrun":
        cmds = [torchrun_cmd(cluster, i, port, f"{mode}{port}", worker_args) for i in (0, 1)]
    else:
        cmds = [accelerate_cmd(cluster, i, port, worker_args) for i in (0, 1)]
    logs = [workdir / f"node{i}.log" for i in (0, 1)]
    env = {"PYTHONPATH": args.pythonpath} if args.pythonpath else {}
    if mode.startswith("ds_"):
        env["DS_ACCELERATOR"] = "cpu"
    doctor = args.doctor and not mode.startswith(("ds_", "ddp"))
    if doctor:  # what `hf-zero doctor` sets: every rank records its profile
        env.update(HF_ZERO_PROFILE_DIR=str(workdir / "profile"), HF_ZERO_PROFILE_STEPS="3")
    outside_before = cluster.link_bytes()
    start = time.perf_counter()
    try:
        codes = cluster.run_all(cmds, timeout=args.timeout, logs=logs, env=env)
    except TimeoutError as err:
        return {"error": str(err), "logs": [str(p) for p in logs]}
    wall = time.perf_counter() - start
    ranks = [json.loads(p.read_text()) for p in sorted(workdir.glob("rank*.json"))]
    if any(codes) or len(ranks) != 4:
        tail = logs[0].read_text().splitlines()[-5:] + logs[1].read_text().splitlines()[-5:]
        return {"error": f"exit codes {codes}", "tail": tail, "logs": [str(p) for p in logs]}
    link = sum(r["link_bytes"] for r in ranks if r["link_bytes"] is not None) / 2
    booked = [r.get("inter_node_wire_bytes") for r in ranks]
    per_collective: dict[str, float] = {}
    for r in ranks:
        for row in r.get("per_collective", []):
            key = f"{row['purpose']}/{row['kind']}/{row['algorithm']}"
            per_collective[key] = per_collective.get(key, 0) + row["off_node_bytes"] / args.steps
    traced: dict[str, list[float]] = {}
    for r in ranks:
        for key, (calls, nbytes) in r.get("traced", {}).items():
            row = traced.setdefault(key, [0, 0])
            row[0] += calls / args.steps / len(ranks)
            row[1] += nbytes / args.steps / len(ranks)
    return {
        "doctor": _doctor(workdir / "profile", args.rate) if doctor else None,
        "traced_per_rank_per_step": {k: v for k, v in traced.items() if v[0]},
        "step_s": statistics.median(r["step_s"] for r in ranks),
        "link_bytes_per_step": link / args.steps,
        "booked_bytes_per_step": None if None in booked else sum(booked) / args.steps,
        "final_loss": statistics.mean(r["losses"][-1] for r in ranks),
        "losses_rank0": ranks[0]["losses"],
        "whole_run_link_bytes": cluster.link_bytes() - outside_before,
        "whole_run_s": wall,
        "per_collective_off_node_bytes": per_collective,
    }


def _doctor(folder: Path, rate: str) -> dict:
    """What `hf-zero doctor --link-gbps <rate> --nodes 2 --gpus-per-node 2` says of a profile."""
    from hf_zero.doctor.advice import Budget, recommend
    from hf_zero.doctor.diagnosis import diagnose, load_profiles

    gbps = float(rate.removesuffix("mbit")) / 1000 if rate.endswith("mbit") else None
    gbps = float(rate.removesuffix("gbit")) if rate.endswith("gbit") else gbps
    d = diagnose(load_profiles(folder))
    changes = recommend(d, Budget(link_gbps=gbps, nodes=2, gpus_per_node=2))
    return {
        "step_s": d.step_s,
        "comm_wait_share": d.comm_wait_share,
        "phases_s": d.phases_s,
        "first": changes[0].kind if changes else None,
        "changes": [(c.kind, round(c.step_s, 4), " ".join(c.flags)) for c in changes],
    }


def per_collective(cluster, args, port: int) -> dict[str, float]:
    """Link bytes per buffer byte of each collective algorithm (`link_per_collective`)."""
    workdir = Path(tempfile.mkdtemp(prefix="hfz-cluster-collectives-"))
    cmds = [
        torchrun_cmd(cluster, i, port, f"coll{port}", ["--out", str(workdir)],
                     HERE / "link_per_collective.py")
        for i in (0, 1)
    ]  # fmt: skip
    logs = [workdir / f"node{i}.log" for i in (0, 1)]
    codes = cluster.run_all(cmds, timeout=args.timeout, logs=logs)
    if any(codes):
        raise RuntimeError(f"link_per_collective failed: see {logs}")
    factors = json.loads((workdir / "collectives.json").read_text())
    print("\n### Bytes on the link per byte of buffer, 2 nodes x 2 ranks\n")
    print("| collective | link bytes / M |\n|---|---:|")
    for name, factor in factors.items():
        print(f"| {name} | {factor:.3f} |")
    return factors


def combine_rounds(runs: list[dict]) -> dict:
    """One row from ``--repeats`` launches of a mode: the median-step launch's numbers, plus
    every launch's step time (``round_steps_s``)."""
    ok = [r for r in runs if "error" not in r]
    if len(ok) < len(runs):
        return next(r for r in runs if "error" in r)
    steps = [r["step_s"] for r in ok]
    median = sorted(ok, key=lambda r: r["step_s"])[(len(ok) - 1) // 2]
    return {**median, "step_s": statistics.median(steps), "round_steps_s": steps}


def round_ratios(row: dict, base: dict) -> str:
    """Per-round ratios to ZeRO-3 (same round, side by side): ``median [min-max]``."""
    ratios = [a / b for a, b in zip(row.get("round_steps_s", []), base.get("round_steps_s", []))]
    if len(ratios) < 2:
        return ""
    return f" (rounds: {statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}])"


def print_table(rate: str, rows: dict[str, dict]) -> None:
    base = rows.get("zero3", {})
    print(f"\n### link {rate} each way, 2 nodes x 2 ranks\n")
    print(
        "| mode | step (s) | vs ZeRO-3 | link MB/step (counters) | comm_stats MB/step "
        "| counters / comm_stats | final loss | loss vs ZeRO-3 |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for mode, r in rows.items():
        if "error" in r:
            print(f"| {LABELS[mode]} | did not run: {r['error']} | | | | | | |")
            continue
        ratio = f"{r['step_s'] / base['step_s']:.2f}x" if "step_s" in base else "-"
        ratio += round_ratios(r, base)
        booked = r["booked_bytes_per_step"]
        agree = f"{r['link_bytes_per_step'] / booked:.3f}" if booked else "-"
        loss_vs = (
            f"{(r['final_loss'] - base['final_loss']) / base['final_loss']:+.2%}"
            if "final_loss" in base
            else "-"
        )
        print(
            f"| {LABELS[mode]} | {r['step_s']:.3f} | {ratio} | {r['link_bytes_per_step'] / 1e6:.1f} "
            f"| {booked / 1e6 if booked else float('nan'):.1f} | {agree} | {r['final_loss']:.4f} "
            f"| {loss_vs} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="200mbit,1gbit,10gbit")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per launch")
    parser.add_argument(
        "--repeats", type=int, default=1, help="interleaved rounds of every mode; median step"
    )
    parser.add_argument("--accelerate", action="store_true", help="also run ZeRO-3 via accelerate")
    parser.add_argument("--per_collective", action="store_true", help="link bytes per algorithm")
    parser.add_argument("--trace", action="store_true", help="count torch.distributed calls")
    parser.add_argument("--profile", action="store_true", help="cProfile rank 0 (workdir)")
    parser.add_argument("--profile_sort", default="tottime")
    parser.add_argument("--extra", default=None, help="more hf_zero config for its modes (JSON)")
    parser.add_argument(
        "--doctor", action="store_true", help="profile hf_zero's modes; the doctor's advice"
    )
    parser.add_argument("--pythonpath", default=None, help="e.g. where DeepSpeed is installed")
    parser.add_argument("--out", default="benchmarks/results/cluster")
    args = parser.parse_args()
    ok, why = simnet.available()
    if not ok:
        sys.exit(f"bench_cluster: cannot build namespaces here: {why}")
    results: dict[str, dict] = {}
    port = 29600
    with simnet.SimCluster() as cluster:
        if args.per_collective:
            cluster.shape(None)
            results["link_bytes_per_collective"] = per_collective(cluster, args, port)
        for rate in args.rates.split(","):
            args.rate = rate
            cluster.shape(None if rate == "none" else rate)
            rows = results.setdefault(rate, {})
            rounds: dict[str, list[dict]] = {}
            for _ in range(args.repeats):  # interleaved, so drifts of the machine hit every mode
                for mode in args.modes.split(","):
                    port += 1
                    rounds.setdefault(mode, []).append(run_one(cluster, mode, args, port))
            for mode, runs in rounds.items():
                rows[mode] = combine_rounds(runs)
            if args.accelerate and rate == "1gbit":
                port += 1
                rows["zero3_accelerate"] = run_one(cluster, "zero3", args, port, "accelerate")
            print_table(rate, rows)
            for mode, row in rows.items():
                if row.get("doctor"):
                    d = row["doctor"]
                    print(
                        f"doctor, {LABELS[mode]} at {rate}: waiting across nodes "
                        f"{100 * d['comm_wait_share']['inter']:.0f}% of the step; first "
                        f"recommendation: {d['first']} ({d['changes'][:3]})"
                    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cluster.json").write_text(json.dumps({"args": vars(args), "rates": results}, indent=2))
    print(f"\nwritten {out / 'cluster.json'}")


if __name__ == "__main__":
    main()
