"""One training run on the simulated cluster; started by torchrun / accelerate in each node.

    torchrun --nnodes 2 --nproc_per_node 2 --node_rank I --rdzv-backend c10d \\
        --rdzv-endpoint ADDR:PORT --local-addr MY_ADDR cluster_rank.py --mode zero3 --out DIR

Modes: ``ddp`` (torch DDP), ``zero3``, ``qwz``, ``hpz``, ``qgz``, ``zeropp`` (all three),
``ds_zero3`` and ``ds_zeropp`` (DeepSpeed, when it imports). Every mode trains the same tiny
Qwen2 from the same seed on the same batches in bf16 (``--precision``), AdamW.

After ``--warmup`` steps, a window of ``--steps`` steps is timed; around it, rank 0 of each node
reads its node's end of the link in ``/proc/net/dev`` (the counters ``ip -s link`` shows). Each
rank writes ``rank<R>.json``: step times, losses, and for hf_zero modes the bytes it sent to other
nodes according to comm_stats, per collective.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from simnet import interface_bytes

ZEROPP = {
    "zero3": {},
    "qwz": {"quantized_weights": True},
    "hpz": {"hpz_partition_size": "auto"},
    "qgz": {"quantized_gradients": True},
    "zeropp": {
        "quantized_weights": True,
        "hpz_partition_size": "auto",
        "quantized_gradients": True,
    },
}


def build_model(args) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=max(128, args.seq_len),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config)


def batches(args, rank: int):
    gen = torch.Generator().manual_seed(1000 + rank)
    while True:
        yield torch.randint(0, args.vocab, (args.batch_size, args.seq_len), generator=gen)


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
TRACED = (
    "all_gather_into_tensor", "all_gather_single", "_all_gather_base", "all_gather",
    "reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base", "reduce_scatter",
    "all_reduce", "broadcast", "all_to_all_single", "all_to_all", "isend", "send",
)  # fmt: skip


def trace_collectives() -> dict[str, list[int]]:
    """Count every torch.distributed collective this process makes (whoever calls it: DDP,
    DeepSpeed, hf_zero): ``{"name/group size": [calls, bytes of its largest buffer]}``."""
    tally: dict[str, list[int]] = {}

    def nbytes(x) -> int:
        if torch.is_tensor(x):
            return x.numel() * x.element_size()
        if isinstance(x, (list, tuple)):
            return sum(nbytes(t) for t in x)
        return 0

    def wrap(name, fn):
        def traced(*args, **kwargs):
            group = kwargs.get("group")
            if group is None:
                group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
            key = f"{name}/{dist.get_world_size(group)}"
            row = tally.setdefault(key, [0, 0])
            row[0] += 1
            row[1] += max([nbytes(a) for a in args] + [nbytes(v) for v in kwargs.values()])
            return fn(*args, **kwargs)

        return traced

    for name in TRACED:
        if hasattr(dist, name):
            setattr(dist, name, wrap(name, getattr(dist, name)))
    return tally


def make_trainer(args):
    """(forward-backward-step function, comm_stats or None) for ``args.mode``."""
    model = build_model(args)
    if args.host_memory == "reuse" and not args.mode.startswith(("zero3", "q", "hpz")):
        from hf_zero.storage import host_memory  # the same allocator setting for DDP and DeepSpeed

        host_memory.reuse_freed_memory()
    if args.mode == "ddp":
        model = model.to(DTYPES[args.precision])
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr)

        def step(x):
            loss = ddp(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        return step, None
    if args.mode.startswith("ds_"):
        import deepspeed

        zero = {"stage": 3, "overlap_comm": True, "contiguous_gradients": True}
        if args.mode == "ds_zeropp":
            zero |= {
                "zero_quantized_weights": True,
                "zero_hpz_partition_size": int(os.environ["LOCAL_WORLD_SIZE"]),
                "zero_quantized_gradients": True,
            }
        config = {
            "train_micro_batch_size_per_gpu": args.batch_size,
            "gradient_accumulation_steps": 1,
            "zero_optimization": zero,
            "zero_allow_untested_optimizer": True,
            "wall_clock_breakdown": False,
        }
        if args.precision == "bf16":
            config["bf16"] = {"enabled": True}
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)

        def step(x):
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            return loss

        return step, None
    import hf_zero

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    engine = hf_zero.initialize(
        model,
        opt,
        stage=3,
        precision=args.precision,
        host_memory=args.host_memory,
        **ZEROPP[args.mode],
        **args.extra,
    )

    def step(x):
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        return loss

    return step, engine.comm_stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", required=True, choices=["ddp", *ZEROPP, "ds_zero3", "ds_zeropp"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--precision", default="bf16", choices=list(DTYPES))
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=32)
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--link", default=None, help="the node's end of the link (counters)")
    parser.add_argument("--host_memory", default="reuse", choices=["reuse", "release"])
    parser.add_argument("--trace", action="store_true", help="count torch.distributed calls")
    parser.add_argument("--profile", action="store_true", help="rank 0: cProfile of the window")
    parser.add_argument("--profile_sort", default="tottime")
    parser.add_argument("--extra", type=json.loads, default={}, help="more hf_zero config (JSON)")
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    tally = trace_collectives() if args.trace else None
    rank = dist.get_rank()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    step, stats = make_trainer(args)
    data = batches(args, rank)
    losses, times = [], []
    for _ in range(args.warmup):
        losses.append(step(next(data)).item())
    dist.barrier()
    link_before = interface_bytes(args.link) if args.link and local_rank == 0 else None
    dist.barrier()  # nobody sends before both nodes have read their counters
    booked_before = stats.copy() if stats is not None else None
    traced_before = {k: list(v) for k, v in tally.items()} if tally is not None else None
    profiler = None
    if args.profile and rank == 0:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    start = time.perf_counter()
    for _ in range(args.steps):
        t0 = time.perf_counter()
        losses.append(step(next(data)).item())
        times.append(time.perf_counter() - t0)
    dist.barrier()
    window = time.perf_counter() - start
    if profiler is not None:
        import io
        import pstats

        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(args.profile_sort).print_stats(45)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "profile_rank0.txt").write_text(text.getvalue())
    result = {
        "mode": args.mode,
        "rank": rank,
        "losses": losses,
        "step_s": statistics.median(times),
        "window_s": window,
        "link_bytes": None,
    }
    if tally is not None:
        result["traced"] = {
            k: [c - traced_before.get(k, [0, 0])[0], b - traced_before.get(k, [0, 0])[1]]
            for k, (c, b) in tally.items()
        }
    if link_before is not None:
        result["link_bytes"] = interface_bytes(args.link) - link_before
    if stats is not None:
        window_stats = stats.since(booked_before)
        result["inter_node_wire_bytes"] = window_stats.wire_bytes(inter_node=True)
        result["per_collective"] = [
            r for r in window_stats.rows() if r["calls"] and r["off_node_bytes"]
        ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
