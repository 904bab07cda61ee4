"""QLoRA on hf_zero: per-rank memory and loss of a bitsandbytes base against a 16-bit base.

    python benchmarks/bench_qlora.py [--hidden 512 --layers 4 --steps 100 --out bench_qlora.json]
    python benchmarks/bench_qlora.py --load --hidden 2048 --layers 8
    python benchmarks/bench_qlora.py --load --partitioned-only --load-modes nf4 --layers 16 ...
    python benchmarks/bench_qlora.py --rss --hidden 2048 --layers 8

``--load`` measures loading alone: each mode's whole ``from_pretrained`` in a fresh process (what
every rank holds before `initialize` shards it), and on 2 ranks the same ``from_pretrained``
inside `partitioned_init()` (each weight sliced as it loads), and a build from the config
(`partitioned_init()` + `load_partitioned()`, LoRA, `initialize` with MixZ++ ``nf4``): the bytes
of weights held per rank, the peak RSS growth, and the peak growth of anonymous memory (without
the memory-mapped checkpoint's pages). ``--rss`` compares, at stage 3 after 3 steps, what the OS says each rank
holds (VmRSS after returning freed heap pages) with `memory_report()`, across bases.

Each row is one fresh 2-rank gloo group (CPU): a LLaMA-shaped model saved once, loaded with
``from_pretrained`` (bf16, or through ``BitsAndBytesConfig`` as NF4 with bf16 storage or as
LLM.int8; or bf16 stored by MixZ++ as INT8 or NF4 shards), LoRA r 16 on every linear layer, ZeRO stage 2 or 3, ``--steps`` AdamW steps on the
embedded corpus. Reported per rank: `memory_report()`'s bytes of the base (``params`` +
``quantized_params``), the peak RSS of the process, and the mean loss of the last 10 steps, with
its ratio to the bf16 base at the same stage.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import llama_shape

MODES = ("bf16", "nf4", "int8", "mixz-int8", "mixz-nf4")
"""The base: bf16, a bitsandbytes NF4 / LLM.int8 load, or a bf16 load stored by MixZ++ (stage 3)
as hf_zero's INT8 blocks or as bitsandbytes NF4 shards."""


def _load(path: str, mode: str):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = None
    if mode.startswith("mixz"):
        quant = None
    elif mode == "nf4":
        quant = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=torch.bfloat16,
            bnb_4bit_quant_storage=torch.bfloat16,
        )
    elif mode == "int8":
        quant = BitsAndBytesConfig(load_in_8bit=True)
    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=quant, dtype=torch.bfloat16
    )
    torch.manual_seed(1)
    lora = LoraConfig(r=16, lora_alpha=16, target_modules="all-linear")
    return get_peft_model(model, lora).train()


def _rank(path: str, mode: str, stage: int, steps: int) -> dict:
    import torch.distributed as dist

    import hf_zero
    from hf_zero.tiny import token_batches

    model = _load(path, mode)
    adapters = [p for p in model.parameters() if p.requires_grad]
    mixz = {"mixz-int8": True, "mixz-nf4": "nf4"}.get(mode, False)
    engine = hf_zero.initialize(
        model,
        torch.optim.AdamW(adapters, lr=2e-3),
        stage=stage,
        precision="bf16",
        quantized_nontrainable_weights=mixz,
    )
    batches = token_batches(64, 4, dist.get_rank(), dist.get_world_size(), seed=0)
    losses = []
    for _ in range(steps):
        x = next(batches)
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
    report = engine.memory_report()
    return {
        "base_bytes": report["params"] + report["quantized_params"],
        "quantized_params": report["quantized_params"],
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "final_loss": sum(losses[-10:]) / 10,
    }


def _status_bytes(key: str) -> int:
    """A ``/proc/self/status`` memory line (kB) in bytes."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(key + ":"))
    return int(line.split()[1]) * 1024


class _Peaks:
    """Peak RSS growth while the block runs: VmHWM (reset at the start) and, sampled every
    2 ms, the anonymous part (RssAnon: what the process itself allocated, without the pages of
    memory-mapped checkpoint files, which the kernel can drop and ranks on a node share)."""

    def __enter__(self):
        import gc
        import threading

        gc.collect()
        self.rss0, self.anon0 = _status_bytes("VmRSS"), _status_bytes("RssAnon")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS: what imports used is not ours
        self.anon_peak, self._stop = self.anon0, threading.Event()

        def sample():
            while not self._stop.wait(0.002):
                self.anon_peak = max(self.anon_peak, _status_bytes("RssAnon"))

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.anon_peak = max(self.anon_peak, _status_bytes("RssAnon"))
        self.rss_growth = _status_bytes("VmHWM") - self.rss0
        self.anon_growth = self.anon_peak - self.anon0


def _held_bytes(model) -> int:
    """Bytes of weights (values, codes, quantization state) this rank's ``model`` holds."""
    from hf_zero.numerics.packed import is_packed, packed_bytes
    from hf_zero.sharding.stage3.partitioned_load import slice_of

    total = 0
    for p in dict.fromkeys(model.parameters()):
        total += packed_bytes(p) if is_packed(p) else p.numel() * p.element_size()
        if slice_of(p) is not None:
            total += slice_of(p).shard.nbytes
    return total


def _load_one(path: str, mode: str) -> dict:
    """In a fresh process: ``from_pretrained`` alone, peak RSS growth and the model's bytes."""
    with _Peaks() as peaks:
        model = _load(path, mode)
    return {
        "base": f"{mode} from_pretrained",
        "peak_rss_growth": peaks.rss_growth,
        "peak_anon_growth": peaks.anon_growth,
        "model_bytes": _held_bytes(model),
    }


def _partitioned_load_rank(path: str, mode: str) -> dict:
    """One rank: ``from_pretrained`` inside `partitioned_init()` (each weight read, quantized
    for a bitsandbytes mode, and sliced as it loads), then LoRA and `initialize` (stage 3)."""
    import hf_zero

    with _Peaks() as loading, hf_zero.partitioned_init(stage=3):
        model = _load(path, mode)
    held = _held_bytes(model)
    with _Peaks() as wrapping:
        adapters = [p for p in model.parameters() if p.requires_grad]
        engine = hf_zero.initialize(model, torch.optim.AdamW(adapters), stage=3, precision="bf16")
    report = engine.memory_report()
    return {
        "base": f"{mode} from_pretrained inside partitioned_init (per rank of 2)",
        "peak_rss_growth": loading.rss_growth,
        "peak_anon_growth": loading.anon_growth,
        "model_bytes": held,
        "initialize_anon_growth": wrapping.anon_growth,
        "engine_bytes": report["params"] + report["quantized_params"],
    }


def _partitioned_rank(path: str) -> dict:
    """One rank: `partitioned_init()` + `load_partitioned()` + LoRA + `initialize` with MixZ++
    ``nf4``: the peak RSS growth from before building to the end of `initialize`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    import hf_zero

    with _Peaks() as peaks:
        with hf_zero.partitioned_init(stage=3):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
        hf_zero.load_partitioned(model, path)
        model.requires_grad_(False)
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=16, target_modules="all-linear"))
        adapters = [p for p in model.parameters() if p.requires_grad]
        engine = hf_zero.initialize(
            model, torch.optim.AdamW(adapters), stage=3, precision="bf16",
            quantized_nontrainable_weights="nf4",
        )  # fmt: skip
    report = engine.memory_report()
    return {
        "base": "partitioned_init + load_partitioned + initialize, MixZ++ nf4 (per rank of 2)",
        "peak_rss_growth": peaks.rss_growth,
        "peak_anon_growth": peaks.anon_growth,
        "model_bytes": report["params"] + report["quantized_params"],
    }


def _rss_rank(path: str, mode: str, steps: int) -> dict:
    """One rank: load, 3 stage-3 steps, then this process's resident memory (after returning
    freed heap pages) against `memory_report()`'s device total."""
    import torch.distributed as dist

    import hf_zero
    from hf_zero.storage import host_memory
    from hf_zero.tiny import token_batches

    model = _load(path, mode)
    adapters = [p for p in model.parameters() if p.requires_grad]
    mixz = {"mixz-int8": True, "mixz-nf4": "nf4"}.get(mode, False)
    engine = hf_zero.initialize(
        model, torch.optim.AdamW(adapters), stage=3, precision="bf16",
        quantized_nontrainable_weights=mixz,
    )  # fmt: skip
    batches = token_batches(32, 2, dist.get_rank(), dist.get_world_size(), seed=0)
    for _ in range(steps):
        x = next(batches)
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
        engine.zero_grad()
    import gc

    gc.collect()
    host_memory.trim()
    report = engine.memory_report()
    return {"base": mode, "rss": _status_bytes("VmRSS"), "report_total": report["total"]}


def _rss_table(args) -> None:
    from hf_zero.testing import run_distributed
    from hf_zero.tiny import tiny_llama

    shape = llama_shape(args.hidden, args.layers, 256, 128)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tiny_llama(0, **shape).to(torch.bfloat16).save_pretrained(tmp)
        for mode in ("bf16", "nf4", "mixz-nf4"):
            rows.append(run_distributed(_rss_rank, 2, args=(tmp, mode, 3), timeout=1800)[0])
    ref = rows[0]
    print(f"stage 3, 2 ranks, hidden {args.hidden} x {args.layers} layers, after 3 steps (rank 0)")
    print("| base | RSS | memory_report total | RSS saved vs bf16 | report saved vs bf16 |")
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['base']} | {row['rss'] / 2**20:.0f} MiB | "
            f"{row['report_total'] / 2**20:.0f} MiB | "
            f"{(ref['rss'] - row['rss']) / 2**20:.0f} MiB | "
            f"{(ref['report_total'] - row['report_total']) / 2**20:.0f} MiB |"
        )
    Path(args.out).write_text(json.dumps(rows, indent=1))


def _load_table(args) -> None:
    import subprocess

    from hf_zero.testing import run_distributed
    from hf_zero.tiny import tiny_llama

    shape = llama_shape(args.hidden, args.layers, 256, 128)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_llama(0, **shape).to(torch.bfloat16)
        params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(tmp)
        del model
        modes = args.load_modes.split(",")
        for mode in [] if args.partitioned_only else modes:
            code = (
                "import json, sys; sys.path.insert(0, 'benchmarks'); import bench_qlora as b; "
                f"print('ROW' + json.dumps(b._load_one({tmp!r}, {mode!r})))"
            )
            out = subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, check=True
            ).stdout
            rows.append(json.loads(next(x for x in out.splitlines() if x.startswith("ROW"))[3:]))
        for mode in modes:
            ranks = run_distributed(_partitioned_load_rank, 2, args=(tmp, mode), timeout=1800)
            rows.append(ranks[0])
        if not args.partitioned_only:
            rows.append(run_distributed(_partitioned_rank, 2, args=(tmp,), timeout=1800)[0])
    print(f"from_pretrained of {params / 1e6:.0f}M parameters (bf16 on disk), rank 0 of each")
    print("| load | weights held per rank | peak RSS growth | peak anonymous growth |")
    print("|---|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['base']} | {row['model_bytes'] / 2**20:.0f} MiB | "
            f"{row['peak_rss_growth'] / 2**20:.0f} MiB | "
            f"{row['peak_anon_growth'] / 2**20:.0f} MiB |"
        )
    for row in rows:
        if "initialize_anon_growth" in row:
            print(
                f"{row['base']}: initialize (gathers one unit at a time) grows anonymous memory "
                f"by {row['initialize_anon_growth'] / 2**20:.0f} MiB; the engine then holds "
                f"{row['engine_bytes'] / 2**20:.0f} MiB of weights"
            )
    Path(args.out).write_text(json.dumps(rows, indent=1))


def main(argv=None) -> None:
    from hf_zero.testing import run_distributed
    from hf_zero.tiny import tiny_llama

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--out", default="bench_qlora.json")
    parser.add_argument("--load", action="store_true", help="measure loading alone")
    parser.add_argument("--rss", action="store_true", help="resident memory after training")
    parser.add_argument("--load-modes", default="bf16,nf4,int8", help="--load: bases to load")
    parser.add_argument(
        "--partitioned-only", action="store_true", help="--load: only partitioned loads"
    )
    args = parser.parse_args(argv)
    if args.load:
        return _load_table(args)
    if args.rss:
        return _rss_table(args)
    shape = llama_shape(args.hidden, args.layers, 256, 128)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tiny_llama(0, initializer_range=0.3, **shape).save_pretrained(tmp)
        for stage in (2, 3):
            for mode in MODES:
                if mode.startswith("mixz") and stage != 3:
                    continue  # MixZ++ is a stage-3 storage
                ranks = run_distributed(_rank, 2, args=(tmp, mode, stage, args.steps), timeout=1800)
                rows.append({"stage": stage, "base": mode, **ranks[0]})
    print(f"hidden {args.hidden}, {args.layers} layers, 2 ranks, bf16, {args.steps} steps")
    print("| stage | base | base MiB/rank | peak RSS MiB | final loss | vs bf16 base |")
    print("|---|---|---:|---:|---:|---:|")
    for row in rows:
        ref = next(r for r in rows if r["stage"] == row["stage"] and r["base"] == "bf16")
        print(
            f"| {row['stage']} | {row['base']} | {row['base_bytes'] / 2**20:.2f} | "
            f"{row['peak_rss'] / 2**20:.0f} | {row['final_loss']:.4f} | "
            f"{row['final_loss'] / ref['final_loss']:.3f}x |"
        )
    Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
