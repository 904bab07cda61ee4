"""Long context under a fixed per-rank memory budget: the longest sequence each configuration
trains, its tokens/s, its loss against the run without SP, hf_zero against DeepSpeed's ALST.

    OMP_NUM_THREADS=1 PYTHONPATH=/work/ds python benchmarks/bench_long_context.py \\
        [--ranks 2,4] [--budget-gib 2] [--configs default|full|NAME,...] [--resolution 4] [--quick]

The model: a LLaMA of about 100M parameters (`long_context_rank.SHAPE_FLAGS`: hidden 768, 8
layers, 12/4 heads, MLP 2048, untied 32K vocabulary), ZeRO-3, fp32, micro-batch 1, AdamW lr 1e-4,
the same seed and batches everywhere. Every probe is a fresh run of one configuration
(`CONFIGS`) on ``--ranks`` ranks (`common.launch_ranks`, gloo): ``--warmup`` + ``--steps``
optimizer steps (1 + 1: the second holds the run's peak) on one sequence per replica. It trains
if it completes with every rank's VmHWM (whole run, from process start) within ``--budget-gib``;
a watcher kills the run once a rank's VmRSS exceeds it (or ``--run-timeout``).

The search: from ``--start`` tokens, double until a length does not train, then bisect to
``1/--resolution`` of the last that did (multiples of 64); a configuration never needing more
memory than another (`WEAKER`) starts within that one's longest. hf_zero's SP configuration and
DeepSpeed's (`PARTNERS`) are searched in lockstep, one run of each in turn.

Reported per configuration: the longest sequence, its tokens/s (all replicas' tokens per timed
optimizer step, median over the runs at that length), its peak, for SP the relative difference
of its first step's loss from one process without SP (`long_context_rank.reference`), and "x
ckpt": the longest over ZeRO-3 + checkpointing's at the same rank count.

hf_zero against DeepSpeed ALST (`long_context_rank_deepspeed.py`: Ulysses SP, TiledMLP, tiled
logits loss, checkpointing, ZeRO-3; the same model, batches, buckets and tiles), `compare`: at
every length up to the shorter longest both run, ``--repeats`` more alternating pairs at the
longest two; the medians of the pairwise tokens/s and peak ratios (``--lengths``: no search,
every configuration at each length, ``--repeats`` rounds). The default set takes about an hour
on 2 cores; ``--configs full`` adds every configuration at both rank counts. Writes
``--out/bench_long_context.json`` (also ``runs.json`` as it goes), a plot of peak RSS against
length (``.png``) and each run's output in ``--out/logs``. Timings are never asserted.

``--allocator unmap`` (default): both engines free large buffers to the OS at once (hf_zero's
``host_memory: unmap``, DeepSpeed `long_context_rank.unmap_large_frees`); ``default``: glibc's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from common import launch_ranks

HERE = Path(__file__).resolve().parent
GIB = 1 << 30
GRANULE = 64  # lengths are multiples of this (every sp size divides it)
CONFIGS = {  # name -> (engine, sp, checkpointing, tiled logits + MLP)
    "plain": ("hf_zero", 1, False, False),
    "ckpt": ("hf_zero", 1, True, False),
    "ckpt+tiled": ("hf_zero", 1, True, True),
    "sp2": ("hf_zero", 2, False, False),
    "sp4": ("hf_zero", 4, False, False),
    "all sp2": ("hf_zero", 2, True, True),
    "all sp4": ("hf_zero", 4, True, True),
    "DS ALST sp2": ("deepspeed", 2, True, True),
    "DS ALST sp4": ("deepspeed", 4, True, True),
}
WEAKER = {  # name -> a configuration that needs at least as much memory at every length
    "ckpt": "plain",
    "ckpt+tiled": "ckpt",
    "sp2": "plain",
    "sp4": "sp2",
    "all sp2": "ckpt+tiled",
    "all sp4": "all sp2",
    "DS ALST sp2": "all sp2",  # not weaker: a first guess, halved from when it does not train
    "DS ALST sp4": "all sp4",
}
PARTNERS = {"all sp2": "DS ALST sp2", "all sp4": "DS ALST sp4"}  # searched side by side
DEFAULT = {  # ranks -> the default run set (what the goals need, in about an hour on 2 cores)
    2: ("plain", "ckpt", "ckpt+tiled", "all sp2", "DS ALST sp2"),
    4: ("ckpt", "all sp4", "DS ALST sp4"),
}
QUICK = dict(ranks="2", configs="ckpt,all sp2,DS ALST sp2", budget_gib=1.0, start=256,
             resolution=2, repeats=1, hidden=256, intermediate=512, layers=2, heads=4,
             kv_heads=2)  # fmt: skip


def configs_for(args: argparse.Namespace, ranks: int) -> list[str]:
    """The configurations of ``--configs`` that run on ``ranks`` ranks (sp divides them), in
    order; ``default``: `DEFAULT` (or all of them at another rank count), ``full``: all."""
    names = {"default": DEFAULT.get(ranks, CONFIGS), "full": CONFIGS}.get(args.configs)
    names = args.configs.split(",") if names is None else names
    return [n.strip() for n in names if ranks % CONFIGS[n.strip()][1] == 0]


# --- one run ------------------------------------------------------------------------------------
def children() -> list[int]:
    """This process's child processes (the ranks)."""
    pids = []
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):
            pids += [int(p) for p in (task / "children").read_text().split()]
    return pids


def rss(pid: int) -> int:
    """VmRSS of ``pid`` in bytes (0 once it has exited)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Watcher(threading.Thread):
    """Kills the ranks when one's RSS exceeds ``budget`` bytes or ``timeout`` s have passed;
    ``reason`` says which, ``peak`` is the largest RSS it saw."""

    def __init__(self, budget: int, timeout: float) -> None:
        super().__init__(daemon=True)
        self.budget, self.deadline = budget, time.monotonic() + timeout
        self.reason, self.peak, self.done = "", 0, threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.05):
            pids = children()
            self.peak = max([self.peak, *(rss(p) for p in pids)])
            if self.peak > self.budget or time.monotonic() > self.deadline:
                self.reason = "memory" if self.peak > self.budget else "time"
                for pid in pids:
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
                return


@contextlib.contextmanager
def output_to(log: Path):
    """The ranks' stdout and stderr (inherited file descriptors 1 and 2) into ``log``."""
    sys.stdout.flush(), sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with log.open("w") as f:
        os.dup2(f.fileno(), 1), os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved[0], 1), os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)


def finished(stem: Path, ranks: int) -> list[dict] | None:
    """The ranks' results when every rank wrote an ``ok`` one (a rank that then failed on its
    way out still trained), else None."""
    files = [stem.with_name(f"{stem.name}.{rank}.json") for rank in range(ranks)]
    with contextlib.suppress(OSError, ValueError):
        out = [json.loads(f.read_text()) for f in files]
        return out if all(r.get("status") == "ok" for r in out) else None
    return None


def model_flags(args: argparse.Namespace) -> list[str]:
    """The model-shape and step flags the workers take."""
    names = ("hidden", "intermediate", "layers", "heads", "kv_heads", "vocab", "steps", "warmup")
    return [a for n in names for a in (f"--{n.replace('_', '-')}", str(getattr(args, n)))]


def run(args: argparse.Namespace, name: str, ranks: int, seq: int) -> dict:
    """One fresh run of configuration ``name`` on ``ranks`` ranks at ``seq`` tokens."""
    engine, sp, checkpointing, tiled = CONFIGS[name]
    worker = "long_context_rank.py" if engine == "hf_zero" else "long_context_rank_deepspeed.py"
    flags = [*model_flags(args), "--seq", str(seq), "--sp", str(sp)]
    flags += ["--checkpointing"] * checkpointing + ["--tiled"] * tiled
    flags += ["--unmap"] * (args.allocator == "unmap")
    stem = f"{name.replace(' ', '_').replace('+', '_')}.{ranks}.{seq}"
    log = args.out / "logs" / f"{stem}.{int(time.time())}.log"
    watcher = Watcher(int(args.budget_gib * GIB), args.run_timeout)
    start = time.perf_counter()
    record = {"config": name, "ranks": ranks, "seq": seq, "log": str(log)}
    for old in (args.out / "tmp").glob(f"{stem}.*.json"):  # no stale results
        old.unlink()
    watcher.start()
    try:
        with output_to(log):
            out = launch_ranks(
                str(HERE / worker), ranks, flags, args.out / "tmp" / stem, name,
                args.run_timeout + 120,
            )  # fmt: skip
    except (RuntimeError, subprocess.TimeoutExpired) as error:
        out = None if watcher.reason else finished(args.out / "tmp" / stem, ranks)
        if out is not None:  # every rank finished its steps and wrote them: it ran
            record["exit"] = f"{error} after writing its results (see {log.name})"
        reason = watcher.reason or f"error: {str(error)[:200]} (see {log.name})"
        if out is None:
            record.update(status=f"over budget ({watcher.peak / GIB:.2f} GiB seen)"
                          if reason == "memory" else reason, peak=watcher.peak)  # fmt: skip
    finally:
        watcher.done.set()
        watcher.join()
    record["wall_s"] = time.perf_counter() - start
    if out is not None:
        peak = max(r["peak"] for r in out)
        step_s = statistics.median(out[0]["step_times"])
        record.update(
            status="ok" if peak <= args.budget_gib * GIB else "over budget",
            peak=peak,
            peak_initialized=max(r["peak_initialized"] for r in out),
            peaks=[r["peak"] for r in out],
            step_s=step_s,
            tokens_per_s=out[0]["tokens_per_step"] / step_s,
            loss=out[0]["losses"][0],
            losses=out[0]["losses"],
        )
    record["fits"] = record["status"] == "ok"
    print(f"  {name:>12} x{ranks} {seq:>7} tokens: {record['status']:<28} "
          f"peak {record['peak'] / GIB:5.2f} GiB  {record['wall_s']:5.0f} s"
          + (f"  {record['tokens_per_s']:7.1f} tokens/s" if out else ""), flush=True)  # fmt: skip
    args.runs.append(record)
    (args.out / "runs.json").write_text(json.dumps(args.runs, indent=1))
    return record


# --- the search ---------------------------------------------------------------------------------
def search(args: argparse.Namespace, first: int):
    """The doubling-then-bisecting search as a generator: yields each length to try, is sent
    its record, returns the record of the longest that trains (None: not even ``--start``)."""
    seq, bad = first, None
    record = yield seq
    while not record["fits"] and seq > args.start:  # the first guess was too long: halve
        bad, seq = seq, seq // 2
        record = yield seq
    if not record["fits"]:
        return None
    good = record
    while bad is None and seq * 2 <= args.max_seq:
        seq *= 2
        record = yield seq
        good, bad = (record, None) if record["fits"] else (good, seq)
    step = max(GRANULE, good["seq"] // args.resolution)
    while bad is not None and bad - good["seq"] > step:
        mid = (good["seq"] + bad) // 2 // GRANULE * GRANULE
        record = yield mid
        good, bad = (record, bad) if record["fits"] else (good, mid)
    return good


def longest(args: argparse.Namespace, ranks: int, firsts: dict[str, int]) -> dict:
    """Search the configurations of ``firsts`` (name -> first length) in lockstep, one run of
    each in turn, so that runs at equal lengths are neighbours in time; name -> longest."""
    searches = {name: search(args, seq) for name, seq in firsts.items()}
    pending = {name: next(s) for name, s in searches.items()}
    found = {}
    while pending:
        for name in list(pending):
            record = run(args, name, ranks, pending[name])
            try:
                pending[name] = searches[name].send(record)
            except StopIteration as stop:
                found[name] = stop.value
                del pending[name]
    return found


def first_length(args: argparse.Namespace, name: str, best: dict) -> int:
    """``--start``, or the largest ``start * 2^k`` within the longest of the nearest `WEAKER`
    configuration searched (its weaker one's when it was not, and so on)."""
    weaker = WEAKER.get(name)
    while weaker and weaker not in best:
        weaker = WEAKER.get(weaker)
    weaker = best.get(weaker)
    seq = args.start
    while weaker and seq * 2 <= weaker["seq"]:
        seq *= 2
    return seq


def reference_loss(args: argparse.Namespace, seq: int) -> float:
    """The first step's loss of sequence 0 without SP (`long_context_rank.reference`)."""
    out = args.out / "tmp" / f"reference.{seq}.json"
    cmd = [sys.executable, str(HERE / "long_context_rank.py"), *model_flags(args)]
    cmd += ["--seq", str(seq), "--reference", "--result", str(out)]
    subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS="2"))
    return json.loads(out.read_text())["loss"]


# --- hf_zero against DeepSpeed ------------------------------------------------------------------
def compare(args: argparse.Namespace, ranks: int, hf: dict, ds: dict) -> list[dict]:
    """hf_zero's and DeepSpeed's runs at every length up to the shorter longest where either
    trained in its search (the other side run there too, where it was not), then ``--repeats``
    more pairs, hf_zero then DeepSpeed, at the longest two; per length the medians of the
    pairwise ratios (runs paired in the order they ran)."""
    top = min(hf["seq"], ds["seq"])
    names = (hf["config"], ds["config"])

    def fitting(name: str) -> set[int]:
        return {r["seq"] for r in args.runs if r["ranks"] == ranks and r["config"] == name
                and r["fits"] and r["seq"] <= top}  # fmt: skip

    for seq in sorted(fitting(names[0]) | fitting(names[1]) | {top}):
        for name in names:
            if seq not in fitting(name):
                run(args, name, ranks, seq)
    lengths = sorted(fitting(names[0]) & fitting(names[1]))
    for seq in lengths[-2:]:
        for _ in range(args.repeats):
            run(args, names[0], ranks, seq), run(args, names[1], ranks, seq)
    return ratios(args, ranks, names, lengths)


def ratios(args: argparse.Namespace, ranks: int, names: tuple, lengths: list[int]) -> list[dict]:
    """Per length where both ``names`` (hf_zero's, DeepSpeed's) trained: the medians of the
    pairwise tokens/s and peak ratios (their runs paired in the order they ran)."""
    rows = []
    for seq in lengths:
        a, b = ([r for r in args.runs if r["ranks"] == ranks and r["config"] == name
                 and r["seq"] == seq and r["fits"]] for name in names)  # fmt: skip
        pairs = list(zip(a, b, strict=False))
        if not pairs:
            continue
        rows.append({
            "ranks": ranks, "seq": seq, "hf_zero": names[0], "deepspeed": names[1],
            "pairs": len(pairs),
            "speed_ratio": statistics.median(x["tokens_per_s"] / y["tokens_per_s"]
                                             for x, y in pairs),
            "peak_ratio": statistics.median(x["peak"] / y["peak"] for x, y in pairs),
            "hf_tokens_per_s": statistics.median(x["tokens_per_s"] for x in a),
            "ds_tokens_per_s": statistics.median(y["tokens_per_s"] for y in b),
            "hf_peak": max(x["peak"] for x in a), "ds_peak": max(y["peak"] for y in b),
        })  # fmt: skip
    return rows


# --- report -------------------------------------------------------------------------------------
def table(args: argparse.Namespace, best: dict, comparisons: list[dict]) -> str:
    """The markdown tables: longest per configuration, then hf_zero / DeepSpeed."""
    lines = [
        f"Per-rank budget {args.budget_gib:g} GiB (max VmHWM over ranks), LLaMA "
        f"{args.hidden}x{args.layers}, vocab {args.vocab}, ZeRO-3 fp32, micro-batch 1, "
        f"{args.warmup}+{args.steps} steps",
        "",
        "| ranks | config | longest seq | x ckpt | tokens/s | step s | peak GiB | "
        "loss rel. diff vs no SP |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    order = list(CONFIGS)
    for (ranks, name), rec in sorted(
        best.items(), key=lambda kv: (kv[0][0], order.index(kv[0][1]))
    ):
        base = best.get((ranks, "ckpt"))
        if rec is None:
            lines.append(f"| {ranks} | {name} | < {args.start} | | | | | |")
            continue
        ratio = f"{rec['seq'] / base['seq']:.1f}x" if base else ""
        same = [r for r in args.runs if r["fits"] and r["ranks"] == ranks
                and r["config"] == name and r["seq"] == rec["seq"]]  # fmt: skip
        speed = statistics.median(r["tokens_per_s"] for r in same)
        diff = f"{rec['loss_rel_diff']:.1e}" if "loss_rel_diff" in rec else ""
        capped = "+" if rec["seq"] * 2 > args.max_seq else ""
        lines.append(
            f"| {ranks} | {name} | {rec['seq']}{capped} | {ratio} | {speed:.1f} "
            f"| {statistics.median(r['step_s'] for r in same):.1f} "
            f"| {max(r['peak'] for r in same) / GIB:.2f} | {diff} |"
        )
    if comparisons:
        lines += [
            "",
            "| ranks | seq | hf_zero tokens/s | DeepSpeed tokens/s | speed hf/DS | "
            "hf peak GiB | DS peak GiB | peak hf/DS |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for c in comparisons:
            lines.append(
                f"| {c['ranks']} | {c['seq']} | {c['hf_tokens_per_s']:.1f} | "
                f"{c['ds_tokens_per_s']:.1f} | {c['speed_ratio']:.2f} | "
                f"{c['hf_peak'] / GIB:.2f} | {c['ds_peak'] / GIB:.2f} | {c['peak_ratio']:.2f} |"
            )
    return "\n".join(lines)


def plot(args: argparse.Namespace, path: Path) -> bool:
    """Peak RSS against sequence length, one line per configuration and rank count."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return False
    counts = sorted({r["ranks"] for r in args.runs})
    fig, axes = plt.subplots(1, len(counts), figsize=(6.5 * len(counts), 4.5), squeeze=False)
    for ax, ranks in zip(axes[0], counts, strict=True):
        for name in CONFIGS:
            runs = [r for r in args.runs if r["ranks"] == ranks and r["config"] == name]
            done = sorted({r["seq"] for r in runs if "peak_initialized" in r})
            if not runs:
                continue
            peaks = [max(r["peak"] for r in runs if r["seq"] == x) / GIB for x in done]
            color = f"C{list(CONFIGS).index(name)}"
            ax.plot(done, peaks, "o--" if "DS" in name else "o-", label=name, color=color)
            killed = [r for r in runs if "peak_initialized" not in r and r.get("peak")]
            ax.plot([r["seq"] for r in killed], [r["peak"] / GIB for r in killed], "x",
                    color=color)  # fmt: skip
        ax.axhline(args.budget_gib, color="k", linewidth=0.8, label="budget")
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}"))
        ax.set(xlabel="sequence length (tokens)", ylabel="peak RSS per rank (GiB)",
               title=f"{ranks} ranks, ZeRO-3, fp32 (x: killed over budget, RSS seen)")  # fmt: skip
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def parse() -> argparse.Namespace:
    """The options (``--quick`` overrides the ones in `QUICK`)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="2,4", help="rank counts, e.g. 2,4")
    p.add_argument("--budget-gib", type=float, default=2.0, help="per-rank peak RSS budget")
    p.add_argument("--configs", default="default", help=f"default, full, or of {list(CONFIGS)}")
    p.add_argument("--resolution", type=int, default=4, help="bisect to 1/N of the last good")
    p.add_argument("--start", type=int, default=512)
    p.add_argument("--max-seq", type=int, default=1 << 17)
    p.add_argument("--run-timeout", type=float, default=900.0, help="seconds per run")
    p.add_argument("--repeats", type=int, default=1, help="more pairs at compared lengths")
    p.add_argument("--lengths", default="", help="no search: these lengths, interleaved")
    p.add_argument(
        "--allocator",
        choices=("unmap", "default"),
        default="unmap",
        help="unmap: host_memory unmap (DeepSpeed: the same mallopt); default: glibc's",
    )
    p.add_argument("--quick", action="store_true", help=f"a few minutes: {QUICK}")
    p.add_argument("--out", type=Path, default=HERE / "results")
    from long_context_rank import SHAPE_FLAGS

    for name, kind, default in [*SHAPE_FLAGS, ("steps", int, 1), ("warmup", int, 1)]:
        p.add_argument(f"--{name}", type=kind, default=default)
    args = p.parse_args()
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    chosen = [] if args.configs in ("default", "full") else args.configs.split(",")
    unknown = [c for c in chosen if c.strip() not in CONFIGS]
    if unknown:
        p.error(f"unknown configurations {unknown}; choose from {list(CONFIGS)}")
    return args


def main() -> None:
    args = parse()
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    (args.out / "tmp").mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    args.runs, best, comparisons = [], {}, []
    for ranks in (int(r) for r in args.ranks.split(",")):
        names = configs_for(args, ranks)
        if args.lengths:  # no search: every configuration in turn at each length, interleaved
            lengths = [int(x) for x in args.lengths.split(",")]
            for seq in lengths:
                for _ in range(max(1, args.repeats)):
                    for name in names:
                        run(args, name, ranks, seq)
            for pair in PARTNERS.items():
                if set(pair) <= set(names):
                    comparisons += ratios(args, ranks, pair, lengths)
            continue
        mine: dict[str, dict | None] = {}
        for name in names:
            if name in mine:
                continue
            firsts = {name: first_length(args, name, mine)}
            partner = PARTNERS.get(name)
            if partner in names:  # hf_zero and DeepSpeed in lockstep, from the same length
                firsts[partner] = firsts[name]
            mine.update(longest(args, ranks, firsts))
        for name, rec in mine.items():
            best[(ranks, name)] = rec
            if rec and CONFIGS[name][1] > 1:
                rec["reference_loss"] = reference_loss(args, rec["seq"])
                rec["loss_rel_diff"] = abs(rec["loss"] - rec["reference_loss"]) / abs(
                    rec["reference_loss"]
                )
        for hf_name, ds_name in PARTNERS.items():
            if mine.get(hf_name) and mine.get(ds_name):
                comparisons += compare(args, ranks, mine[hf_name], mine[ds_name])
    report = table(args, best, comparisons)
    print(report)
    out = args.out / "bench_long_context.json"
    summary = {"args": {k: str(v) for k, v in vars(args).items() if k != "runs"},
               "best": [v for v in best.values() if v], "comparisons": comparisons,
               "runs": args.runs, "table": report}  # fmt: skip
    out.write_text(json.dumps(summary, indent=1))
    png = out.with_suffix(".png")
    print(f"wrote {out}" + (f" and {png}" if plot(args, png) else ""))


if __name__ == "__main__":
    main()
