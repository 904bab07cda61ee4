"""ZeRO-Infinity side by side: stage 3 with model states on device, in CPU memory, on NVMe, and
DeepSpeed's ZeRO-Infinity on the same model and machine.

    OMP_NUM_THREADS=1 PYTHONPATH=/work/dslib python benchmarks/bench_infinity.py --hidden 1024 \
        --layers 24 --nvme_path /tmp/hf_zero_bench_nvme --deepspeed

First the disk: a ``--bw_gib`` GiB file in ``--nvme_path`` is written and read back sequentially
through the same swap I/O the NVMe tiers use (`hf_zero.storage.swap`: O_DIRECT, aligned 16 MiB
requests, ``--io_threads`` threads), by ``--nproc`` processes at once, as the ranks share the
disk in training. Then, per configuration, a fresh group of ``--nproc`` ranks (gloo, one thread
each) lives a whole run: builds a LLaMA-style model inside `hf_zero.partitioned_init()` (never
whole on a rank), runs ``--steps`` AdamW steps (torch's fused CPU kernel wherever the optimizer
is offloaded), an evaluation forward, and saves the model (the streamed ``save_pretrained``).
Per rank: step times; the optimizer step's time and the bytes it read and wrote (the kernel's
count, ``/proc/self/io``: O_DIRECT and libaio alike); VmHWM (peak RSS) from process start over the
whole run (``peak``) and over the steps (``peak_steps``); VmRSS at ``base`` (imports and process
group, nothing built); `memory_report()`; and what ``hf-zero estimate`` prints for the
configuration (model states in memory, stage 3's working set, activations, and under NVMe
`hf_zero.memory.infinity_bytes`' I/O buffers), against which the growth over ``base`` is read.

The NVMe optimizer step reads and writes at once, so its bound is the time the disk needs for
its bytes at the measured rate of that mix (the ``mixed`` phase: every process reads its first
file while writing a second): ``(read_bytes + write_bytes) / mixed_bw``, all ranks' bytes, one
disk. ``bound / step`` is the fraction of that bound the step reaches (1.0 = disk-limited).
``--reduce_bucket_size auto`` (h^2, what the Hugging Face DeepSpeed JSONs ask for) everywhere;
``default`` passes none, as a config that names no sizes.

``--deepspeed`` adds DeepSpeed 0.19.8's ``cpu/cpu`` and ``nvme/nvme`` rows
(`infinity_rank_deepspeed.py`: its NVMe path needs the async_io op, built from libaio's headers,
``apt-get install libaio-dev``); where DeepSpeed cannot run the table says why. Writes
``--out/bench_infinity.json``. Timings here are never asserted anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_memory import proc_io, proc_status, reset_peak
from common import launch_ranks

CONFIGS = {  # name -> (offload_param, offload_optimizer)
    "stage 3": ("none", "none"),
    "stage 3 + offload cpu/cpu": ("cpu", "cpu"),
    "stage 3 + optimizer nvme": ("none", "nvme"),
    "Infinity nvme/nvme": ("nvme", "nvme"),
}
MIB = 1 << 20


# --- the disk ------------------------------------------------------------------------------------
def disk_worker(args) -> dict:
    """One process's share of the bandwidth test: write a file, read it back, then read it
    while writing a second one (the optimizer step's pattern: reads and writes overlap)."""
    import torch

    from hf_zero.storage.swap import SwapSpace

    space = SwapSpace(args.nvme_path, rank=int(os.environ["RANK"]), threads=args.io_threads)
    request = 16 * MIB // 4  # fp32 elements per request
    numel = int(args.bw_gib * (1 << 30)) // 4 // args.nproc
    numel -= numel % request
    first, second = space.file("bandwidth", numel * 4), space.file("bandwidth2", numel * 4)
    buffers = [space.buffer(request, torch.float32).fill_(1.0) for _ in range(2 * args.io_threads)]
    out = {"direct": space.direct, "bytes": numel * 4}
    phases = {
        "write": [first.write_async],
        "read": [first.read_async],
        "mixed": [first.read_async, second.write_async],
    }
    for name, ops in phases.items():
        _barrier(args, name)
        start = time.perf_counter()
        pending, issued = [], 0
        for offset in range(0, numel, request):
            for op in ops:
                if len(pending) == len(buffers):
                    pending.pop(0).result()  # the oldest request: its buffer is next in the ring
                pending.append(op(buffers[issued % len(buffers)], offset * 4))
                issued += 1
        for done in pending:
            done.result()
        out[f"{name}_s"] = time.perf_counter() - start
    space.close()
    return out


def _barrier(args, name: str) -> None:
    """Start each phase together (a file barrier: no process group needed)."""
    flag = Path(args.nvme_path) / f".phase.{name}.{os.environ['RANK']}"
    flag.touch()
    while len(list(Path(args.nvme_path).glob(f".phase.{name}.*"))) < args.nproc:
        time.sleep(0.01)


# --- training ------------------------------------------------------------------------------------
def train_worker(args) -> dict:
    import torch
    import torch.distributed as dist
    from common import llama_shape
    from transformers import LlamaForCausalLM

    import hf_zero
    from hf_zero.memory import shape_of
    from hf_zero.tiny import tiny_llama_config

    offload_param, offload_optimizer = CONFIGS[args.worker]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    config = tiny_llama_config(**llama_shape(args.hidden, args.layers, args.vocab, args.seq_len))
    with torch.device("meta"):
        shape = shape_of(LlamaForCausalLM(config))
    base = proc_status()
    torch.manual_seed(0)
    zero = dict(
        stage=3,
        offload_param=offload_param,
        offload_optimizer=offload_optimizer,
        nvme_path=args.nvme_path,
        nvme_io_threads=args.io_threads,
    )
    zero["max_reuse_distance"] = int(args.max_reuse_distance)  # units kept forward to backward
    if args.host_memory != "default":
        zero["host_memory"] = args.host_memory
    if offload_param == "nvme":  # the host budget for parameter shards
        zero["offload_param_max_in_cpu"] = int(args.max_in_cpu)
    if offload_optimizer == "nvme" and args.optimizer_max_in_cpu:
        zero["offload_optimizer_max_in_cpu"] = int(args.optimizer_max_in_cpu)
    if args.reduce_bucket_size != "default":  # "default": what a config that names none gets
        zero["reduce_bucket_size"] = _int_or_auto(args.reduce_bucket_size)
    with hf_zero.partitioned_init(**zero):
        model = LlamaForCausalLM(config)
    engine = hf_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), **zero)
    initialized = proc_status()
    reset_peak()
    record, x = timed_steps(engine, args, rank, engine.swaps.get("offload_optimizer"))
    peak_steps = proc_status()
    # The rest of a run's life: an evaluation forward, then the model saved (streamed).
    with torch.no_grad():
        engine(input_ids=x, labels=x)
    save_dir = Path(args.nvme_path) / f"saved.{args.worker.replace(' ', '_').replace('/', '-')}"
    save_start = time.perf_counter()
    engine.save_pretrained(save_dir, is_main_process=rank == 0)
    save_s = time.perf_counter() - save_start
    whole_run = proc_status()
    report = engine.memory_report()
    largest_shard = max(g.layout.shard_numel for g in engine.groups)
    dist.barrier()
    engine.close()
    dist.destroy_process_group()
    if rank == 0:
        shutil.rmtree(save_dir, ignore_errors=True)
    return {
        "config": args.worker,
        "rank": rank,
        "params": shape.params,
        "base_rss": base["VmRSS"],
        "initialized_rss": initialized["VmRSS"],
        "build_peak": initialized["VmHWM"],
        "peak": max(initialized["VmHWM"], whole_run["VmHWM"]),  # from process start
        "peak_steps": peak_steps["VmHWM"],
        **record,
        "save_s": save_s,
        "memory_report": report,
        "estimate": _estimate(shape, engine, args, offload_param, offload_optimizer),
        "largest_shard": largest_shard,
    }


def timed_steps(engine, args, rank: int, swap=None) -> tuple[dict, object]:
    """``args.steps`` steps on this rank's random batches, timed and counted the same way for
    every engine (hf_zero's and DeepSpeed's): each step's time, its optimizer step's time and
    the bytes the process read and wrote meanwhile (``os_io``; ``optimizer_io``: the swap
    space's own count, given ``swap``), and the losses. Returns them and the last batch."""
    import torch
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(1000 + rank)
    record = {"steps": [], "optimizer_steps": [], "optimizer_io": [], "os_io": [], "losses": []}
    for _ in range(args.steps):
        x = torch.randint(0, args.vocab, (args.batch_size, args.seq_len), generator=gen)
        dist.barrier()
        start = time.perf_counter()
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        before, os_before = dict(swap.stats) if swap else {}, proc_io()
        opt_start = time.perf_counter()
        engine.step()
        end = time.perf_counter()
        os_after = proc_io()
        record["steps"].append(end - start)
        record["optimizer_steps"].append(end - opt_start)
        record["optimizer_io"].append({k: swap.stats[k] - v for k, v in before.items()})
        record["os_io"].append({k: os_after[k] - os_before[k] for k in os_after})
        record["losses"].append(loss.item())
    return record, x


def _estimate(shape, engine, args, offload_param: str, offload_optimizer: str) -> float:
    """What `hf-zero estimate` prints for this configuration (per rank, from the process's
    start): model states held in memory, stage 3's working set with the prefetch budget,
    activations, and under NVMe the I/O buffers (`hf_zero.memory.infinity_bytes`)."""
    from hf_zero.memory import activation_bytes, estimate, infinity_bytes, working_set_bytes

    prefetch = engine.config.prefetch_bucket_size
    activations = activation_bytes(shape, args.seq_len, args.batch_size, "fp32")
    if offload_optimizer == "nvme":
        m = infinity_bytes(
            shape, args.nproc, "fp32", offload_param == "nvme",
            engine.config.offload_param_buffer_count,
            engine.config.offload_optimizer_buffer_count, prefetch,
            engine.config.offload_param_max_in_cpu, engine.config.offload_optimizer_max_in_cpu,
        )  # fmt: skip
        return m["params"] + m["working_set"] + activations
    m = estimate(shape, args.nproc, 3, "fp32", offload_optimizer == "cpu", offload_param=offload_param == "cpu")  # fmt: skip
    states = m["total"] + m["host_total"]
    # Units kept from forward to backward: at most max_live_parameters, never the root twice.
    held = min(
        args.max_reuse_distance and engine.config.max_live_parameters,
        shape.params - shape.root_unit_params,
    )
    return states + working_set_bytes(shape, 3, "fp32") + 4 * (prefetch + held) + activations


def _int_or_auto(text: str) -> int | str:
    return text if text == "auto" else int(text)


# --- the driver ----------------------------------------------------------------------------------
def launch(args, worker: str, mode: str, tmp: Path) -> list[dict]:
    """Fresh ranks running ``--disk`` or ``--train`` ``worker`` with the forwarded options."""
    flags = [f"--{mode}", worker]
    flags += [a for k, v in vars(args).items() if k in FORWARDED for a in (f"--{k}", str(v))]
    stem = tmp / f"{mode}.{worker.replace(' ', '_').replace('/', '-')}"
    return launch_ranks(__file__, args.nproc, flags, stem, worker, args.timeout)


FORWARDED = (
    "hidden",
    "layers",
    "vocab",
    "seq_len",
    "batch_size",
    "steps",
    "reduce_bucket_size",
    "nvme_path",
    "io_threads",
    "max_in_cpu",
    "max_reuse_distance",
    "host_memory",
    "optimizer_max_in_cpu",
    "bw_gib",
    "nproc",
)


def deepspeed_status() -> str:
    """Why DeepSpeed's NVMe offload can or cannot run on this machine."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except ImportError:
        reason = "DeepSpeed is not importable (PYTHONPATH=/work/dslib, see its worker)"
    else:
        if AsyncIOBuilder().is_compatible(verbose=False):
            return "available"
        reason = "DeepSpeed's async_io op is not compatible here"
    if not Path("/usr/include/libaio.h").exists():
        reason += (
            "; its async_io op (the only NVMe path of ZeRO-Infinity) needs libaio's headers: "
            "apt-get install libaio-dev"
        )
    return reason


def summarize(disk: list[dict], runs: dict[str, list[dict]]) -> dict:
    total = sum(d["bytes"] for d in disk)
    read_bw = total / max(d["read_s"] for d in disk)
    write_bw = total / max(d["write_s"] for d in disk)
    mixed_bw = 2 * total / max(d["mixed_s"] for d in disk)  # bytes read + written per second
    rows = {}
    plain = runs.get("stage 3")

    def mean_step(ranks: list[dict]) -> float:
        measured = slice(1, None)  # the first step records the trace, creates the state files
        return sum(sum(r["steps"][measured]) for r in ranks) / sum(
            len(r["steps"][measured]) for r in ranks
        )

    for name, ranks in runs.items():
        measured = slice(1, None)
        opt = max(sum(r["optimizer_steps"][measured]) / len(r["steps"][measured]) for r in ranks)
        row = {
            "step_s": mean_step(ranks),
            "optimizer_step_s": opt,
            "peak_rss_mb": max(r["peak"] for r in ranks) / MIB,
            "peak_steps_rss_mb": max(r["peak_steps"] for r in ranks) / MIB,
            "base_rss_mb": max(r["base_rss"] for r in ranks) / MIB,
            "growth_mb": max(r["peak"] - r["base_rss"] for r in ranks) / MIB,
            "final_loss": ranks[0]["losses"][-1],
            "losses": ranks[0]["losses"],
        }
        if "estimate" in ranks[0]:
            row.update(
                estimate_mb=ranks[0]["estimate"] / MIB,
                save_s=max(r["save_s"] for r in ranks),
                disk_mb_per_rank=ranks[0]["memory_report"]["nvme_total"] / MIB,
            )
        io = [r["os_io"][-1] for r in ranks]  # the kernel's count: O_DIRECT and libaio alike
        read, write = sum(i["read_bytes"] for i in io), sum(i["write_bytes"] for i in io)
        if read + write > 1 << 20:
            # The step reads and writes at once: its bound is the disk's rate for that mix.
            bound = (read + write) / mixed_bw
            row.update(io_read_mb=read / MIB, io_write_mb=write / MIB, io_bound_s=bound)
            row["bound_fraction"] = bound / opt
        if plain:
            plain_growth = max(r["peak"] - r["base_rss"] for r in plain)
            row["rss_growth_vs_stage3"] = row["growth_mb"] * MIB / plain_growth
            row["step_vs_stage3"] = row["step_s"] / mean_step(plain)
        rows[name] = row
    for name, ds_name in (("Infinity nvme/nvme", "DeepSpeed nvme/nvme"),
                          ("stage 3 + offload cpu/cpu", "DeepSpeed cpu/cpu")):  # fmt: skip
        if name in rows and ds_name in rows:
            rows[name]["step_vs_deepspeed"] = rows[name]["step_s"] / rows[ds_name]["step_s"]
            rows[name]["peak_vs_deepspeed"] = (
                rows[name]["peak_rss_mb"] / rows[ds_name]["peak_rss_mb"]
            )
    return {
        "disk": {
            "read_gbps": read_bw / 1e9,
            "write_gbps": write_bw / 1e9,
            "mixed_gbps": mixed_bw / 1e9,
            "o_direct": disk[0]["direct"],
        },
        "rows": rows,
        "params": next((r[0]["params"] for r in runs.values() if "params" in r[0]), 0),
        "deepspeed": deepspeed_status(),
    }


def table(summary: dict) -> str:
    d = summary["disk"]
    lines = [
        f"model: {summary['params'] / 1e6:.0f}M parameters; disk (O_DIRECT={d['o_direct']}): "
        f"read {d['read_gbps']:.2f} GB/s, write {d['write_gbps']:.2f} GB/s, read and write at "
        f"once {d['mixed_gbps']:.2f} GB/s (the bound below)",
        "",
        "| config | step (s) | vs stage 3 | vs DeepSpeed | optimizer step (s) | step I/O r/w (MB) "
        "| disk bound (s) | bound / step | peak RSS (MB) | vs DeepSpeed | growth (MB) "
        "| growth vs stage 3 | estimate (MB) | growth / estimate | disk per rank (MB) | save (s) "
        "| final loss |",
        "|---|" + "---:|" * 16,
    ]
    for name, r in summary["rows"].items():
        bound = f"{r['io_bound_s']:.2f}" if "io_bound_s" in r else ""
        frac = f"**{r['bound_fraction']:.2f}**" if "bound_fraction" in r else ""
        est = r.get("estimate_mb")
        cells = [
            name, f"{r['step_s']:.2f}", f"{r.get('step_vs_stage3', 1):.2f}x",
            f"{r['step_vs_deepspeed']:.2f}x" if "step_vs_deepspeed" in r else "",
            f"{r['optimizer_step_s']:.2f}",
            f"{r['io_read_mb']:.0f} / {r['io_write_mb']:.0f}" if "io_read_mb" in r else "",
            bound, frac, f"{r['peak_rss_mb']:.0f}",
            f"{r['peak_vs_deepspeed']:.2f}x" if "peak_vs_deepspeed" in r else "",
            f"{r['growth_mb']:.0f}", f"{r.get('rss_growth_vs_stage3', 1):.2f}x",
            f"{est:.0f}" if est else "", f"{r['growth_mb'] / est:.2f}" if est else "",
            f"{r['disk_mb_per_rank']:.0f}" if "disk_mb_per_rank" in r else "",
            f"{r['save_s']:.1f}" if "save_s" in r else "", f"{r['final_loss']:.4f}",
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"DeepSpeed ZeRO-Infinity: {summary['deepspeed']}"]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq_len", type=int, default=32)
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument(
        "--reduce_bucket_size",
        default="auto",
        help="elements, auto (h^2), or default (none given: hf_zero's defaults)",
    )
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument(
        "--max_in_cpu", type=float, default=0, help="nvme/nvme: offload_param_max_in_cpu elements"
    )
    p.add_argument(
        "--max_reuse_distance", type=float, default=0, help="hf_zero's max_reuse_distance"
    )
    p.add_argument(
        "--optimizer_max_in_cpu",
        type=float,
        default=0,
        help="nvme optimizer: offload_optimizer_max_in_cpu elements",
    )
    p.add_argument(
        "--host_memory", default="default", help="hf_zero's host_memory (default: not given)"
    )
    p.add_argument("--nvme_path", default="/tmp/hf_zero_bench_nvme")
    p.add_argument("--io_threads", type=int, default=4)
    p.add_argument("--bw_gib", type=float, default=4.0, help="bandwidth test size, all ranks")
    p.add_argument("--only", nargs="*", default=None, help="configuration names to run")
    p.add_argument(
        "--deepspeed",
        action="store_true",
        help="add DeepSpeed 0.19.8's ZeRO-Infinity (cpu and nvme) rows (see its worker)",
    )
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--train", help=argparse.SUPPRESS)
    p.add_argument("--disk", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--table", help="print the table of an earlier run's JSON, run nothing")
    args = p.parse_args(argv)
    if args.table:
        saved = json.loads(Path(args.table).read_text())
        print(table(summarize(saved["disk"], saved["runs"])))
        return 0
    if args.train or args.disk:
        args.worker = args.train or args.disk
        result = train_worker(args) if args.train else disk_worker(args)
        Path(args.result).write_text(json.dumps(result))
        return 0
    Path(args.nvme_path).mkdir(parents=True, exist_ok=True)
    tmp = Path(args.out) / "bench_infinity_ranks"
    tmp.mkdir(parents=True, exist_ok=True)
    for flag in Path(args.nvme_path).glob(".phase.*"):
        flag.unlink()
    disk = launch(args, "bandwidth", "disk", tmp)
    runs = {}
    for name in CONFIGS:
        if args.only is None or name in args.only:
            print(f"running {name} ...", file=sys.stderr, flush=True)
            runs[name] = launch(args, name, "train", tmp)
    if args.deepspeed and deepspeed_status() == "available":
        for device in ("cpu", "nvme"):
            name = f"DeepSpeed {device}/{device}"
            print(f"running {name} ...", file=sys.stderr, flush=True)
            flags = [a for k, v in vars(args).items() if k in FORWARDED for a in (f"--{k}", str(v))]
            script = str(Path(__file__).with_name("infinity_rank_deepspeed.py"))
            stem = tmp / f"ds.{device}"
            runs[name] = launch_ranks(
                script, args.nproc, [*flags, "--ds_device", device], stem, name, args.timeout
            )
            shutil.rmtree(Path(args.nvme_path) / "zero_stage_3", ignore_errors=True)  # its swap
    summary = summarize(disk, runs)
    summary["args"] = {k: v for k, v in vars(args).items() if k in FORWARDED}
    out = Path(args.out) / "bench_infinity.json"
    out.write_text(json.dumps({"summary": summary, "disk": disk, "runs": runs}, indent=1))
    shutil.rmtree(tmp, ignore_errors=True)
    for flag in Path(args.nvme_path).glob(".phase.*"):
        flag.unlink()
    print(table(summary))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
