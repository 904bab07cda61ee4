"""One training step of a ~1B-parameter LLaMA-style model with ZeRO-3 and the optimizer on the CPU.

World size 1 on ``cuda:0``, bf16 compute, fp32 master weights and Adam state in host memory:

* hf_zero stage 3, ``offload_optimizer="cpu"``, its copy-back overlapped with the CPU Adam update
  (each finished tile of master weights starts its host-to-device copy while the next is updated);
* the same with that overlap off (``engine.optimizer.overlap_copy_back = False``: the CPU step,
  then every copy);
* DeepSpeed stage 3 with ``offload_optimizer: cpu`` (when ``deepspeed`` imports);
* FSDP2 ``fully_shard`` with ``CPUOffloadPolicy`` (parameters too, as FSDP2 offloads them together).

Each system runs in its own process (so its memory is its own), ``--steps`` steps, the median of
the steps after ``--warmup``, printed as a table with ratios to hf_zero, and written as
``bench_gpu_offload.json`` under ``--out``. Run by the GPU lane (scripts/gpu_check.py); on a
machine without CUDA it runs the same code on CPU with gloo (``--hidden 64 --layers 2`` there:
the lane's CPU-side test), where the timings mean nothing.

    python benchmarks/bench_gpu_offload.py --out results/gpu-check
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

SYSTEMS = ["hf_zero", "hf_zero (no copy-back overlap)", "DeepSpeed", "FSDP2 CPUOffloadPolicy"]


def build(args, device: torch.device) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4 // 64 * 64 or 64,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 256),
        max_position_embeddings=args.seq_len,
    )
    torch.manual_seed(0)
    with device:
        return LlamaForCausalLM(config)


def make(name: str, args, device: torch.device):
    """``(forward-backward-step callable, parameter count)`` for one system."""
    model = build(args, device)
    params = sum(p.numel() for p in model.parameters())
    lm = lambda m, x: m(input_ids=x, labels=x).loss  # noqa: E731
    if name.startswith("hf_zero"):
        import hf_zero

        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        engine = hf_zero.initialize(model, opt, stage=3, precision="bf16", offload_optimizer="cpu")
        engine.optimizer.overlap_copy_back = "no copy-back" not in name

        def step(x):
            engine.backward(lm(engine, x))
            engine.step()

        return step, params
    if name == "DeepSpeed":
        import deepspeed

        config = {
            "train_micro_batch_size_per_gpu": args.batch_size,
            "bf16": {"enabled": True},
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": {"device": "cpu", "pin_memory": True},
            },
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}},
        }
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )

        def step(x):
            engine.backward(lm(engine, x))
            engine.step()

        return step, params
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    policy = dict(
        offload_policy=CPUOffloadPolicy(pin_memory=device.type == "cuda"),
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16),
    )
    for layer in model.model.layers:
        fully_shard(layer, **policy)
    fully_shard(model, **policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def step(x):
        lm(model, x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, params


def worker(args) -> None:
    from hf_zero.comm.topology import current_device, init_distributed

    init_distributed()
    device = current_device()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    start = time.perf_counter()
    step, params = make(args.worker, args, device)
    setup_s = time.perf_counter() - start
    gen = torch.Generator().manual_seed(0)
    times = []
    for _ in range(args.steps):
        x = torch.randint(0, 32000, (args.batch_size, args.seq_len), generator=gen).to(device)
        sync()
        t0 = time.perf_counter()
        step(x)
        sync()
        times.append(time.perf_counter() - t0)
    result = {
        "params": params,
        "setup_s": setup_s,
        "step_s": statistics.median(times[args.warmup :]),
        "steps_s": times,
        "peak_cuda_bytes": torch.cuda.max_memory_allocated() if device.type == "cuda" else 0,
    }
    Path(args.result).write_text(json.dumps(result))


def run_system(name: str, args, out: Path) -> dict:
    result = out / f"gpu_offload_{SYSTEMS.index(name)}.json"
    result.unlink(missing_ok=True)
    from hf_zero.testing import free_port

    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    cmd = [sys.executable, __file__, "--worker", name, "--result", str(result)]
    cmd += [f"--{k}={getattr(args, k)}" for k in ("hidden", "layers", "seq_len", "batch_size")]
    cmd += [f"--steps={args.steps}", f"--warmup={args.warmup}"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0 or not result.exists():
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        return {"skipped": (lines[-1] if lines else f"exit {done.returncode}")[:200]}
    return json.loads(result.read_text())


def table(rows: dict[str, dict], args) -> str:
    base = rows.get("hf_zero", {}).get("step_s")
    params = next((r["params"] for r in rows.values() if "params" in r), 0)
    lines = [
        f"{params / 1e9:.2f}B parameters (hidden {args.hidden}, {args.layers} layers), bf16, "
        f"ZeRO-3 + CPU optimizer offload, world size 1, batch {args.batch_size} x {args.seq_len}",
        "",
        "| system | step (s) | vs hf_zero | setup (s) | peak GPU memory (GiB) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in rows.items():
        if "skipped" in r:
            lines.append(f"| {name} | skipped: {r['skipped']} | | | |")
            continue
        ratio = f"{r['step_s'] / base:.2f}x" if base else ""
        lines.append(
            f"| {name} | {r['step_s']:.3f} | {ratio} | {r['setup_s']:.1f} "
            f"| {r['peak_cuda_bytes'] / 2**30:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=22)  # 1.1B with hidden 2048 (TinyLlama)
    parser.add_argument("--seq_len", type=int, default=1024)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=300, help="seconds per system")
    parser.add_argument("--only", nargs="*", default=None, help="systems whose name contains")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = [n for n in SYSTEMS if not args.only or any(s in n for s in args.only)]
    rows = {}
    for name in names:
        rows[name] = run_system(name, args, out)
        print(f"{name}: {rows[name].get('step_s', rows[name].get('skipped'))}", flush=True)
    text = table(rows, args)
    print(text)
    report = {"args": vars(args), "rows": rows, "table": text}
    (out / "bench_gpu_offload.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
