"""Training step side by side: torch DDP, ZeroRedundancyOptimizer, FSDP2, DeepSpeed, hf_zero.

    OMP_NUM_THREADS=1 python benchmarks/bench_train.py --nproc 2 --hidden 768 --layers 12 \\
        --steps 6 --repeats 2

One workload for every system: a LLaMA-style model built from config (``--hidden``, ``--layers``,
vocabulary 32000, tied embeddings), the same seed, the same batches per rank, AdamW. Each system
runs in its own ``torchrun`` group of ``--nproc`` ranks (so its memory peak is its own), systems
one after another in rounds (``--repeats``), medians over rounds; the table gives per system
the median step time (forward + backward + optimizer step, first step excluded) and its ratio to
hf_zero at the same stage, the peak resident memory it added per rank, the bytes its collectives
moved per step, and its final loss relative to DDP's.

Bytes: what each rank sends on the wire per step, counted here for every ``torch.distributed``
call made from Python (collectives and point-to-point sends) by the algorithm it uses on N ranks
(ring all-reduce 2(N-1)/N of the buffer, reduce-scatter / all-gather (N-1)/N, a send its
tensor); DDP's reducer runs in C++, so its row shows the ring all-reduce formula and says so. Memory:
the process's peak resident set (max over ranks, includes the ~0.4 GB of imported libraries) and
its growth from before the model is built (activations and allocator slack included); ``model state`` is hf_zero's
``memory_report()`` against the ZeRO formula (`hf_zero.memory`). DeepSpeed rows need ``deepspeed``
(``DS_ACCELERATOR=cpu`` on a machine without GPUs); they are skipped, and listed as skipped, when
it does not import. Writes JSON and a PNG to ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from common import llama_shape

# --- communication counter ------------------------------------------------------------------------
# Bytes this rank sends on the wire, by the algorithm each call uses on N ranks: a ring all-reduce
# 2(N-1)/N of the buffer, a reduce-scatter / all-gather (N-1)/N of the full buffer, a point-to-point
# send its tensor (a receive sends nothing). M is the largest tensor argument.
_RING = lambda m, n: (n - 1) * m // n  # noqa: E731
COUNTED = {
    "all_reduce": lambda m, n: 2 * (n - 1) * m // n,
    "all_gather_into_tensor": _RING,
    "all_gather_single": _RING,
    "reduce_scatter_tensor": _RING,
    "reduce_scatter_single": _RING,
    "broadcast": _RING,  # gloo/NCCL pipeline it as a ring: about (N-1)/N per rank on average
    "all_to_all_single": _RING,
    "all_gather": _RING,
    "reduce_scatter": _RING,
    "isend": lambda m, n: m,
    "send": lambda m, n: m,
}


class CommCounter:
    """Counts bytes of Python-level torch.distributed collectives (outermost calls only)."""

    def __init__(self) -> None:
        self.bytes = 0
        self._local = threading.local()  # nesting depth per thread (hf_zero sends from a worker)
        self._lock = threading.Lock()
        self._originals: dict[str, Callable] = {}

    def install(self) -> None:
        """Patch ``torch.distributed`` and ``distributed_c10d`` (libraries call either); must run
        before the systems under test import, since some bind the functions at import time."""
        for name, wire in COUNTED.items():
            original = getattr(c10d, name, None) or getattr(dist, name, None)
            if original is None:
                continue
            wrapped = self._wrap(original, wire)
            for namespace in (dist, c10d):
                if getattr(namespace, name, None) is original:
                    setattr(namespace, name, wrapped)

    def _wrap(self, fn: Callable, wire: Callable[[int, int], int]) -> Callable:
        def counted(*args, **kwargs):
            depth = getattr(self._local, "depth", 0)
            if depth == 0:
                values = [*args[:2], *kwargs.values()]  # DeepSpeed passes tensors by keyword
                sizes = [_nbytes(v) for v in values]
                group = kwargs.get("group") or next(
                    (a for a in args[2:] if isinstance(a, dist.ProcessGroup)), None
                )
                with self._lock:
                    self.bytes += wire(max(sizes, default=0), dist.get_world_size(group))
            self._local.depth = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._local.depth = depth

        return counted


COUNTER = CommCounter()
COUNTER.install()

import hf_zero  # noqa: E402  (after the counter: hf_zero binds collectives at import)
from hf_zero.comm.topology import current_device, init_distributed  # noqa: E402
from hf_zero.memory import model_state_bytes  # noqa: E402
from hf_zero.tiny import tiny_llama  # noqa: E402


def _nbytes(value) -> int:
    if torch.is_tensor(value):
        return value.numel() * value.element_size()
    if isinstance(value, list | tuple) and value and torch.is_tensor(value[0]):
        return sum(t.numel() * t.element_size() for t in value)
    return 0


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# --- systems ----------------------------------------------------------------------------------------
class Run:
    """One system under test: ``loss(x)``, ``backward(loss)``, ``step()``, optional report."""

    def __init__(self, loss, backward, step, report=None, formula_bytes=None) -> None:
        self.loss, self.backward, self.step = loss, backward, step
        self.report = report
        self.formula_bytes = formula_bytes


def build(args) -> torch.nn.Module:
    shape = llama_shape(args.hidden, args.layers, args.vocab, args.seq_len)
    return tiny_llama(0, **shape).to(current_device())


def lm_loss(model):
    return lambda x: model(input_ids=x, labels=x).loss


def make_ddp(args) -> Run:
    model = build(args)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return Run(
        lm_loss(ddp),
        lambda loss: loss.backward(),
        lambda: (opt.step(), opt.zero_grad(set_to_none=True)),
        formula_bytes=2 * (dist.get_world_size() - 1) * grad_bytes // dist.get_world_size(),
    )


def make_zero_redundancy(args) -> Run:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = build(args)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=args.lr)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return Run(
        lm_loss(ddp),
        lambda loss: loss.backward(),
        lambda: (opt.step(), opt.zero_grad(set_to_none=True)),
        formula_bytes=2
        * (dist.get_world_size() - 1)
        * grad_bytes
        // dist.get_world_size(),  # DDP's all-reduce; the broadcasts are counted on top
    )


def make_fsdp(args, reshard: bool) -> Run:
    from torch.distributed.fsdp import fully_shard

    model = build(args)
    for layer in model.model.layers:
        fully_shard(layer, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    return Run(
        lm_loss(model),
        lambda loss: loss.backward(),
        lambda: (opt.step(), opt.zero_grad(set_to_none=True)),
    )


def make_deepspeed(args, stage: int, offload: bool = False) -> Run:
    import deepspeed

    model = build(args)
    zero = {"stage": stage, "overlap_comm": False}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {
        "train_micro_batch_size_per_gpu": args.batch_size,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr}},
    }
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    return Run(lm_loss(engine), engine.backward, engine.step)


def make_hf_zero(args, stage: int, **cfg) -> Run:
    model = build(args)
    params = sum(p.numel() for p in model.parameters())  # before stage 3 releases them
    if args.host_memory:
        cfg = {"host_memory": args.host_memory, **cfg}
    engine = hf_zero.initialize(
        model,
        torch.optim.AdamW(model.parameters(), lr=args.lr),
        stage=stage,
        reduce_bucket_size=args.reduce_bucket_size,
        **cfg,
    )
    offload = cfg.get("offload_optimizer") == "cpu"

    def report() -> dict:
        measured = engine.memory_report()
        formula = model_state_bytes(params, engine.topology.dp_size, stage, "fp32", offload)
        key = "host_total" if offload else "total"
        both = measured["total"] + measured["host_total"]
        return {
            "model_state_bytes": both,
            "formula_bytes": formula["total"] + formula["host_total"],
            "formula_kind": key,
        }

    return Run(lm_loss(engine), engine.backward, engine.step, report)


def systems(args) -> dict[str, tuple[int | None, Callable[[], Run]]]:
    """name -> (the hf_zero stage it is compared with, factory)."""
    table: dict[str, tuple[int | None, Callable[[], Run]]] = {
        "torch DDP": (0, lambda: make_ddp(args)),
        "torch ZeroRedundancyOptimizer": (1, lambda: make_zero_redundancy(args)),
        "FSDP2 fully_shard": (3, lambda: make_fsdp(args, True)),
        "FSDP2 (reshard_after_forward=False)": (2, lambda: make_fsdp(args, False)),
    }
    try:
        import deepspeed  # noqa: F401

        for stage in (1, 2, 3):
            table[f"DeepSpeed stage {stage}"] = (stage, lambda s=stage: make_deepspeed(args, s))
        table["DeepSpeed stage 2 offload"] = (-2, lambda: make_deepspeed(args, 2, True))
    except Exception as error:  # ImportError, or an accelerator probe failing
        table["DeepSpeed (skipped)"] = (None, lambda e=error: _skip(e))
    for stage in (0, 1, 2, 3):
        table[f"hf_zero stage {stage}"] = (stage, lambda s=stage: make_hf_zero(args, s))
    table["hf_zero stage 2 offload"] = (
        -2,
        lambda: make_hf_zero(args, 2, offload_optimizer="cpu"),
    )
    table["hf_zero stage 3 ZeRO++ (qwZ+qgZ)"] = (
        3,
        lambda: make_hf_zero(args, 3, quantized_weights=True, quantized_gradients=True),
    )
    if args.only:
        table = {k: v for k, v in table.items() if any(s in k for s in args.only)}
    return table


def _skip(error: Exception) -> Run:
    raise RuntimeError(f"skipped: {error}")


# --- measuring ------------------------------------------------------------------------------------
def measure(factory: Callable[[], Run], args, rank: int) -> dict:
    gc.collect()
    base = rss_bytes()
    peak = base
    run = factory()
    gen = torch.Generator().manual_seed(1000 + rank)
    times, losses = [], []
    COUNTER.bytes = 0
    counted_steps = 0
    for step in range(args.steps):
        x = torch.randint(0, args.vocab, (args.batch_size, args.seq_len), generator=gen)
        x = x.to(current_device())
        if step == 1:
            COUNTER.bytes, counted_steps = 0, 0  # the first step includes setup traffic
        start = time.perf_counter()
        loss = run.loss(x)
        peak = max(peak, rss_bytes())
        run.backward(loss)
        peak = max(peak, rss_bytes())
        if step == args.steps - 1 and run.report is not None:
            state = run.report()  # model states peak here: gradients not yet freed by the step
        run.step()
        peak = max(peak, rss_bytes())
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
        counted_steps += step >= 1
    result = {
        "step_s": statistics.median(times[1:]),
        "final_loss": losses[-1],
        "peak_rss_added_bytes": peak - base,
        "comm_bytes_per_step": COUNTER.bytes / max(1, counted_steps),
    }
    if run.formula_bytes is not None:
        result["comm_bytes_per_step"] += run.formula_bytes
        result["comm_note"] = "DDP all-reduce by formula (C++ reducer)"
    if run.report is not None:
        result.update(state)
    del run
    gc.collect()
    dist.barrier()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks per system run")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument(
        "--reduce_bucket_size",
        type=int,
        default=6_250_000,
        help="hf_zero bucket elements (default 25 MB of fp32, DDP's bucket_cap_mb)",
    )
    parser.add_argument(
        "--host_memory",
        choices=["release", "unmap", "reuse"],
        help="hf_zero's host_memory setting (default: the config's own)",
    )
    parser.add_argument("--only", nargs="*", help="run systems whose name contains one of these")
    parser.add_argument("--out", default="benchmarks/results/train")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # one system, under torchrun
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    if args.worker:
        worker(args)
    else:
        drive(args, parser)


def drive(args, parser) -> None:
    """Run every system in its own torchrun group (so memory peaks are its own), round-robin."""
    import subprocess
    import sys
    import tempfile

    table = systems(args)
    passthrough = []
    for action in parser._actions:
        if action.dest in ("help", "worker", "result", "only", "out", "repeats", "nproc"):
            continue
        if getattr(args, action.dest) is None:
            continue
        passthrough += [action.option_strings[0], str(getattr(args, action.dest))]
    results: dict[str, list[dict]] = {name: [] for name in table}
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(args.repeats):
            for name in table:
                if name in skipped:
                    continue
                result = Path(tmp) / "result.json"
                result.unlink(missing_ok=True)
                command = [
                    sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                    str(args.nproc), "--master_port", str(_free_port()), __file__,
                    *passthrough, "--worker", name, "--result", str(result),
                ]  # fmt: skip
                done = subprocess.run(command, capture_output=True, text=True)
                if done.returncode != 0 or not result.exists():
                    lines = [ln for ln in done.stderr.splitlines() if "Error" in ln]
                    why = (lines[-1] if lines else f"exit {done.returncode}")[:160]
                    skipped[name] = f"round {round_index + 1}: {why}"
                    continue
                results[name].append(json.loads(result.read_text()))
                print(f"round {round_index + 1}: {name} done", flush=True)
    report(args, args.nproc, table, results, skipped)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(args) -> None:
    """One system on this torchrun group; rank 0 writes its figures (memory: max over ranks)."""
    import resource

    init_distributed()
    rank = dist.get_rank()
    factory = systems(args)[args.worker][1]
    result = measure(factory, args, rank)
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    result["peak_rss_bytes"] = peak.item()
    if rank == 0:
        Path(args.result).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def report(args, world, table, results, skipped) -> None:
    rows = {}
    for name, runs in results.items():
        if runs:
            rows[name] = {
                k: statistics.median(r[k] for r in runs)
                if isinstance(runs[0][k], float | int)
                else runs[0][k]
                for k in runs[0]
            }
    params = sum(p.numel() for p in build(args).parameters())
    ddp = rows.get("torch DDP")
    ours = {stage: rows.get(f"hf_zero stage {stage}") for stage in (0, 1, 2, 3)}
    ours[-2] = rows.get("hf_zero stage 2 offload")
    print(
        f"\n{params / 1e6:.0f}M parameters (hidden {args.hidden}, {args.layers} layers), fp32, "
        f"world size {world}, batch {args.batch_size} x {args.seq_len}, {args.steps} steps "
        f"(first excluded) x {args.repeats} rounds\n"
    )
    print(
        "| system | step (s) | vs hf_zero same stage | peak RSS per rank (MB) | added by the run "
        "(MB) | wire MB/step per rank | final loss vs DDP | model state vs formula |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        stage = table[name][0]
        peer = ours.get(stage)
        ratio = f"{r['step_s'] / peer['step_s']:.2f}x" if peer else ""
        loss = f"{(r['final_loss'] - ddp['final_loss']) / ddp['final_loss']:+.1e}" if ddp else ""
        state = f"{r['model_state_bytes'] / r['formula_bytes']:.3f}" if "formula_bytes" in r else ""
        comm = f"{r['comm_bytes_per_step'] / 1e6:.1f}" + ("*" if "comm_note" in r else "")
        print(
            f"| {name} | {r['step_s']:.3f} | {ratio} | {r['peak_rss_bytes'] / 1e6:.0f} "
            f"| {r['peak_rss_added_bytes'] / 1e6:.0f} | {comm} | {loss} | {state} |"
        )
    for name, why in skipped.items():
        print(f"| {name} | skipped: {why} ||||||")
    print("\n* DDP's all-reduce runs in C++: counted by formula (2(N-1)/N x gradient bytes).")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.json").write_text(
        json.dumps({"args": vars(args), "rows": rows, "skipped": skipped}, indent=2)
    )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = list(rows)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    axes[0].barh(names, [rows[n]["step_s"] for n in names])
    axes[0].set_xlabel("step time (s)")
    axes[1].barh(names, [rows[n]["peak_rss_bytes"] / 1e6 for n in names])
    axes[1].set_xlabel("peak RSS per rank (MB)")
    axes[1].set_yticks([])
    fig.tight_layout()
    fig.savefig(out / "train.png", dpi=120)


if __name__ == "__main__":
    main()
