"""Resident memory from outside: each rank's RSS against `hf-zero estimate`, per ZeRO config.

    OMP_NUM_THREADS=1 python benchmarks/bench_memory.py --hidden 768 --layers 12

Per configuration (stage 1-3, fp32 and bf16, stage-2/3 offload) a fresh group of ``--nproc``
processes (one per rank, gloo, ``OMP_NUM_THREADS=1``) builds a LLaMA-style model from config
(vocabulary 32000, tied embeddings; under stage 3 inside `hf_zero.partitioned_init()`, so no rank
ever holds it whole), calls `initialize()` and runs ``--steps`` training steps (AdamW,
``--batch_size`` x ``--seq_len`` tokens). Each rank reads ``VmRSS`` and ``VmHWM`` from
``/proc/self/status`` (the peak is reset by writing 5 to ``/proc/self/clear_refs`` before the
steps) at: ``base`` (imports and process group done, the libraries warmed up on a tiny model
(`warm_up_libraries`), nothing built), after the build, after `initialize()`, after the last
step's backward (``peak``: the model-state peak, gradients held, before the optimizer step) and
after that step (``between`` steps). The RSS growth from ``base``
is compared with `hf_zero.memory.estimate` for the same model, ranks and precision: at the peak
and between steps (``between_steps=True``), device plus host bytes (on a CPU machine both are this
process's memory). The same points' `memory_report()` totals are reported next to the RSS.

What RSS holds beyond the model states, and so what the ratios include: activations and logits
(small at ``--seq_len 32``), stage 3's gathered units (the root unit with the embeddings stays
gathered from forward into backward), freed memory the allocator has not returned (glibc keeps
small freed blocks; tensors of 32 MiB and more are unmapped on free), and hf_zero's own fixed
costs (the libraries' first-use buffers are made before ``base``). The JSON keeps every reading;
the table prints the ratios.
Writes ``--out/bench_memory.json``. No timings here and none asserted anywhere.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import sys
from pathlib import Path

STORAGE_16BIT = {"stage 3 bf16 16-bit", "stage 3 bf16 offload 16-bit"}
"""Configurations with bf16 master weights and optimizer state (``master_weights_dtype``,
``optimizer_states_dtype``)."""
STATES_16BIT = {"stage 3 bf16 offload 16-bit state"}
"""Configurations with bf16 optimizer state alone (offloaded: the host keeps it)."""
CONFIGS = {
    "stage 1 fp32": (1, "fp32", False),
    "stage 2 fp32": (2, "fp32", False),
    "stage 3 fp32": (3, "fp32", False),
    "stage 2 fp32 offload": (2, "fp32", True),
    "stage 3 fp32 offload": (3, "fp32", True),
    "stage 1 bf16": (1, "bf16", False),
    "stage 2 bf16": (2, "bf16", False),
    "stage 3 bf16": (3, "bf16", False),
    "stage 2 bf16 offload": (2, "bf16", True),
    "stage 3 bf16 offload": (3, "bf16", True),
    "stage 3 bf16 16-bit": (3, "bf16", False),
    "stage 3 bf16 offload 16-bit state": (3, "bf16", True),
    "stage 3 bf16 offload 16-bit": (3, "bf16", True),
}


# --- reading the process's memory --------------------------------------------------------------
def proc_status() -> dict[str, int]:
    """VmRSS and VmHWM of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def proc_io() -> dict[str, int]:
    """Bytes this process (all its threads) read from and wrote to storage: the kernel's
    count (``/proc/self/io``), O_DIRECT and libaio included."""
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("read_bytes", "write_bytes"):
                out[key] = int(value)
    return out


def trim() -> bool:
    """Return the allocator's free pages to the system (glibc ``malloc_trim``); False if absent."""
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0) or True)
    except (OSError, AttributeError):
        return False


def reset_peak() -> bool:
    """Make VmHWM restart from the current RSS (False where the kernel does not allow it)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# --- one rank ----------------------------------------------------------------------------------
def model_config(args):
    from common import llama_shape

    from hf_zero.tiny import tiny_llama_config

    return tiny_llama_config(**llama_shape(args.hidden, args.layers, args.vocab, args.seq_len))


def warm_up_libraries(precision: str) -> None:
    """Run what every configuration runs once, on a model too small to matter, so that the
    libraries' first-use buffers (autograd's engine, the CPU matmul kernels' scratch for this
    dtype, gloo's pairs) exist before ``base`` and are not counted as model states. Plain torch
    only: hf_zero's own fixed costs stay in the growth."""
    import torch
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    from hf_zero.comm.collectives import all_gather_single, reduce_scatter_single
    from hf_zero.tiny import tiny_llama_config

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = LlamaForCausalLM(tiny_llama_config()).to(dtype)
    x = torch.randint(0, model.config.vocab_size, (1, 4))
    model(input_ids=x, labels=x).loss.backward()
    torch.optim.AdamW(model.parameters()).step()
    flat, world = torch.zeros(1024, dtype=dtype), dist.get_world_size()
    dist.all_reduce(flat)
    all_gather_single(torch.empty(flat.numel() * world, dtype=dtype), flat)
    reduce_scatter_single(flat[: flat.numel() // world].clone(), flat)
    del model, flat
    gc.collect()
    trim()


def worker(args) -> dict:
    import torch
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    import hf_zero
    from hf_zero.memory import activation_bytes, estimate, shape_of, working_set_bytes

    stage, precision, offload = CONFIGS[args.worker]
    compact = args.worker in STORAGE_16BIT
    states_16bit = args.worker in STATES_16BIT
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = model_config(args)
    with torch.device("meta"):
        shape = shape_of(LlamaForCausalLM(config))  # what `hf-zero estimate` would count
    warm_up_libraries(precision)  # ends with a collection and a trim
    dist.barrier()
    readings = {"base": proc_status()}
    torch.manual_seed(0)
    if stage == 3:
        with hf_zero.partitioned_init():
            model = LlamaForCausalLM(config)
    else:
        model = LlamaForCausalLM(config)
    readings["built"] = proc_status()
    reset_peak()
    engine = hf_zero.initialize(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-4),
        stage=stage,
        precision=precision,
        offload_optimizer="cpu" if offload else "none",
        reduce_bucket_size=args.reduce_bucket_size,
        **(
            dict.fromkeys(("master_weights_dtype", "optimizer_states_dtype"), "bf16")
            if compact
            else {}
        ),
        **({"optimizer_states_dtype": "bf16"} if states_16bit else {}),
    )
    gc.collect()
    readings["initialized"] = proc_status()  # VmHWM here: the peak of initialize()
    peak_reset = reset_peak()
    gen = torch.Generator().manual_seed(1000 + rank)
    reports = {}
    for step in range(args.steps):
        last = step == args.steps - 1
        if last:
            readings["before_last_step"] = proc_status()  # VmHWM: the earlier steps' peak
            reset_peak()
        x = torch.randint(0, args.vocab, (args.batch_size, args.seq_len), generator=gen)
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        del loss
        if last:
            engine.optimizer.prepare_grads()  # offload: the host gradient copy has landed
            readings["peak"] = proc_status()  # VmHWM: forward and backward
            reports["peak"] = engine.memory_report()
            trim()
            readings["peak_trimmed"] = proc_status()
            reset_peak()
        engine.step()
    gc.collect()
    readings["between"] = proc_status()  # VmHWM: the last optimizer step
    trim()
    readings["between_trimmed"] = proc_status()
    reports["between"] = engine.memory_report()
    common = dict(precision=precision, offload=offload, storage_16bit=compact)
    common["optimizer_states_16bit"] = states_16bit
    est_peak = estimate(shape, world, stage, **common)
    est_between = estimate(shape, world, stage, between_steps=True, **common)
    work = working_set_bytes(shape, stage, precision)
    acts = activation_bytes(shape, args.seq_len, args.batch_size, precision)
    largest_shard = max(g.layout.shard_numel for g in engine.groups)
    dist.barrier()
    dist.destroy_process_group()
    return {
        "config": args.worker,
        "rank": rank,
        "world": world,
        "params": shape.params,
        "readings": readings,
        "peak_reset": peak_reset,
        "memory_report": reports,
        "estimate_peak": est_peak["total"] + est_peak["host_total"],
        "estimate_between": est_between["total"] + est_between["host_total"],
        "working_set": work,
        "activations": acts,
        "step_transient": 4 * largest_shard,  # one bucket's fp32 gradient inside the step
    }


# --- the driver --------------------------------------------------------------------------------
def run_config(name: str, args, tmp: Path) -> list[dict]:
    """Launch a fresh group of ``args.nproc`` processes for one configuration."""
    from common import launch_ranks

    flags = ["--worker", name, *_size_flags(args)]
    stem = tmp / name.replace(" ", "_")
    return launch_ranks(__file__, args.nproc, flags, stem, name, args.timeout)


def _size_flags(args) -> list[str]:
    keys = ("hidden", "layers", "vocab", "seq_len", "batch_size", "steps", "reduce_bucket_size")
    return [arg for k in keys for arg in (f"--{k}", str(getattr(args, k)))]


def summarize(results: list[dict]) -> dict:
    """Max over ranks of the RSS growth at each point, against the estimate."""
    worst = {}
    for point, key in (("peak", "estimate_peak"), ("between", "estimate_between")):
        grown = max(r["readings"][point]["VmRSS"] - r["readings"]["base"]["VmRSS"] for r in results)
        trimmed = max(
            r["readings"][point + "_trimmed"]["VmRSS"] - r["readings"]["base"]["VmRSS"]
            for r in results
        )
        report = max(
            r["memory_report"][point]["total"] + r["memory_report"][point]["host_total"]
            for r in results
        )
        estimate = results[0][key]
        worst[point] = {
            "rss_growth": grown,
            "estimate": estimate,
            "ratio": grown / estimate,
            "rss_growth_trimmed": trimmed,
            "ratio_trimmed": trimmed / estimate,
            "memory_report": report,
            "report_vs_estimate": report / estimate,
        }
    r0 = results[0]
    for name, point in (
        ("initialize_hwm", "initialized"),
        ("first_steps_hwm", "before_last_step"),
        ("backward_hwm", "peak"),
        ("step_hwm", "between"),
    ):
        hwm = max(r["readings"][point]["VmHWM"] - r["readings"]["base"]["VmRSS"] for r in results)
        worst[name] = {"rss_growth": hwm, "ratio": hwm / r0["estimate_peak"]}
    worst["transients"] = {k: r0[k] for k in ("working_set", "activations", "step_transient")}
    points = ("built", "initialized", "before_last_step", "peak", "between")
    worst["peak_rss"] = max(r["readings"][k]["VmHWM"] for r in results for k in points)
    return worst


def table(rows: dict[str, dict], params: int) -> str:
    from hf_zero.memory import formula

    lines = [
        f"{params / 1e6:.1f}M parameters; per rank, max over ranks; MB = 1e6 bytes; RSS growth "
        "from before the model is built, as read (raw) and after malloc_trim(0) (trimmed)",
        "",
        "| config | formula (device) | estimate (MB) | RSS growth raw / trimmed (MB) | "
        "ratio raw / trimmed | memory_report (MB) | between steps: estimate / RSS raw / "
        "trimmed (MB) | ratio trimmed | VmHWM growth: initialize / fwd+bwd / step (MB) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, w in rows.items():
        stage, precision, offload = CONFIGS[name]
        compact, states_16bit = name in STORAGE_16BIT, name in STATES_16BIT
        text = formula(stage, precision, offload, storage_16bit=compact)
        host = "10P/N" if compact else "12P/N" if states_16bit else "16P/N"
        text += f" + host {host}" if offload else ""
        p, b = w["peak"], w["between"]
        hwm = " / ".join(
            f"{w[k]['rss_growth'] / 1e6:.0f}"
            for k in ("initialize_hwm", "backward_hwm", "step_hwm")
        )
        lines.append(
            f"| {name} | {text} | {p['estimate'] / 1e6:.0f} | {p['rss_growth'] / 1e6:.0f} / "
            f"{p['rss_growth_trimmed'] / 1e6:.0f} | {p['ratio']:.3f} / {p['ratio_trimmed']:.3f} | "
            f"{p['memory_report'] / 1e6:.0f} | {b['estimate'] / 1e6:.0f} / "
            f"{b['rss_growth'] / 1e6:.0f} / {b['rss_growth_trimmed'] / 1e6:.0f} | "
            f"{b['ratio_trimmed']:.3f} | {hwm} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq_len", type=int, default=32)
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--reduce_bucket_size", type=int, default=50_000_000)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--only", nargs="*", help="config names, or substrings of them, to run")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        Path(args.result).write_text(json.dumps(worker(args)))
        return 0
    exact = [n for n in args.only or () if n in CONFIGS]
    names = exact or [n for n in CONFIGS if not args.only or any(s in n for s in args.only)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "bench_memory_ranks"
    tmp.mkdir(exist_ok=True)
    rows, raw = {}, {}
    for name in names:
        raw[name] = run_config(name, args, tmp)
        rows[name] = summarize(raw[name])
        print(f"{name}: {json.dumps(rows[name])}", flush=True)
    params = raw[names[0]][0]["params"]
    print(table(rows, params))
    sizes = {k: getattr(args, k) for k in ("hidden", "layers", "vocab", "seq_len", "batch_size")}
    result = {"args": sizes, "params": params, "summary": rows, "ranks": raw}
    (out / "bench_memory.json").write_text(json.dumps(result, indent=1))
    for f in tmp.iterdir():
        f.unlink()
    tmp.rmdir()
    return 0


if __name__ == "__main__":
    sys.exit(main())
