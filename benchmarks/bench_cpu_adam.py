"""CPU Adam throughput, side by side in one run: parameters updated per second.

    python benchmarks/bench_cpu_adam.py [--numel 50000000] [--repeats 7] [--json out.json]

Runs, interleaved and repeated (median reported):
  hf_zero CPUAdam (fp32 state), hf_zero CPUAdam (bf16 state), torch AdamW(foreach=True),
  torch AdamW(fused=True), and DeepSpeedCPUAdam where `deepspeed` imports.
The memory-bandwidth bound: an fp32 Adam step reads p, g, m, v and writes p, m, v = 28 bytes per
parameter (bf16 state: 20); the bound is the measured memory bandwidth (best of STREAM copy,
scale and triad) divided by that. Prints a
table, writes JSON (and a PNG bar chart where matplotlib imports).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from hf_zero.optim import CPUAdam


def memory_bandwidth(numel: int, repeats: int) -> float:
    """Achievable bytes per second: the best of three STREAM-style kernels (median each).

    copy (a = b: 8 B/elem), scale in place (a *= s: 8 B/elem), triad (a = b + s*c: 12 B/elem),
    all on the intra-op threads, on tensors far larger than the caches.
    """
    a, b, c = torch.randn(numel), torch.randn(numel), torch.randn(numel)
    kernels = {
        "copy": (lambda: a.copy_(b), 8),
        "scale": (lambda: a.mul_(1.0000001), 8),
        "triad": (lambda: torch.add(b, c, alpha=0.5, out=a), 12),
    }
    best = 0.0
    for run, bytes_per_elem in kernels.values():
        run()  # first touch
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        best = max(best, bytes_per_elem * numel / statistics.median(times))
    return best


def make_runners(numel: int) -> dict[str, Callable[[], None]]:
    torch.manual_seed(0)
    grad = torch.randn(numel)
    runners = {}

    def runner(build):
        p = torch.nn.Parameter(torch.randn(numel))
        p.grad = grad
        opt = build([p])
        opt.step()  # allocate state outside the timing
        return opt.step

    hyper = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    runners["hf_zero CPUAdam"] = runner(lambda ps: CPUAdam(ps, **hyper))
    runners["hf_zero CPUAdam (bf16 state)"] = runner(
        lambda ps: CPUAdam(ps, state_dtype=torch.bfloat16, **hyper)
    )
    runners["torch AdamW(foreach=True)"] = runner(
        lambda ps: torch.optim.AdamW(ps, foreach=True, **hyper)
    )
    runners["torch AdamW(fused=True)"] = runner(
        lambda ps: torch.optim.AdamW(ps, fused=True, **hyper)
    )
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        runners["DeepSpeedCPUAdam"] = runner(lambda ps: DeepSpeedCPUAdam(ps, **hyper))
    except Exception as error:
        print(f"DeepSpeedCPUAdam not available: {type(error).__name__}: {str(error)[:120]}")
    return runners


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=50_000_000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", default="benchmarks/results/cpu_adam.json")
    args = parser.parse_args(argv)

    bandwidth = memory_bandwidth(args.numel, args.repeats)
    runners = make_runners(args.numel)
    times: dict[str, list[float]] = {name: [] for name in runners}
    names = list(runners)
    for repeat in range(args.repeats):
        # Interleaved, and each round starts at a different row, so drift and cache state left
        # by the previous row affect every row alike.
        for i in range(len(names)):
            name = names[(repeat + i) % len(names)]
            step = runners[name]
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)

    rows = []
    fastest_other = max(
        args.numel / statistics.median(t) for n, t in times.items() if not n.startswith("hf_zero")
    )
    for name, samples in times.items():
        rate = args.numel / statistics.median(samples)
        bytes_per_param = 20 if "bf16" in name else 28
        bound = bandwidth / bytes_per_param
        rows.append(
            {
                "optimizer": name,
                "median_s": statistics.median(samples),
                "params_per_s": rate,
                "vs_fastest_peer": rate / fastest_other,
                "bandwidth_bound_params_per_s": bound,
                "fraction_of_bound": rate / bound,
            }
        )
    print(
        f"\n{args.numel / 1e6:.0f}M fp32 parameters, {torch.get_num_threads()} threads, "
        f"memory bandwidth {bandwidth / 1e9:.2f} GB/s (best STREAM kernel), median of "
        f"{args.repeats}\n"
    )
    header = (
        f"{'optimizer':<30} {'step (ms)':>10} {'Mparam/s':>10} {'vs best peer':>13} {'of bound':>9}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['optimizer']:<30} {r['median_s'] * 1e3:>10.1f} {r['params_per_s'] / 1e6:>10.1f} "
            f"{r['vs_fastest_peer']:>12.2f}x {r['fraction_of_bound']:>8.0%}"
        )
    result = {
        "numel": args.numel,
        "threads": torch.get_num_threads(),
        "memory_bandwidth_bytes_per_s": bandwidth,
        "torch": torch.__version__,
        "rows": rows,
    }
    if args.json:
        from pathlib import Path

        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(8, 3.5))
            ax.barh([r["optimizer"] for r in rows], [r["params_per_s"] / 1e6 for r in rows])
            ax.axvline(
                bandwidth / 28 / 1e6, color="k", linestyle="--", label="fp32 bandwidth bound"
            )
            ax.set_xlabel("million parameters updated per second")
            ax.legend()
            fig.tight_layout()
            fig.savefig(out.with_suffix(".png"), dpi=120)
        except ImportError:
            pass
    return result


if __name__ == "__main__":
    main()
