"""One rank of benchmarks/bench_long_context.py: hf_zero ZeRO-3 training one long sequence.

Launched one process per rank by `common.launch_ranks` (gloo, one thread each; ``--result``
appended). The model is `hf_zero.tiny.tiny_llama` with the shape flags below (a LLaMA of about
100M parameters, 32K vocabulary, untied head); micro-batch 1, fp32, AdamW. With ``--sp N`` each
group of N consecutive ranks shares one sequence (every rank of the group passes the same full
batch, hf_zero splits it); the world has ``world / N`` data-parallel replicas, replica ``d``
training sequence ``d`` of each step (`sequence`). ``--warmup`` untimed steps, then ``--steps``
timed ones (forward, backward, optimizer step; a barrier before each). Each rank writes its step
times, losses (its replica's whole-sequence loss) and VmHWM (peak RSS over the whole run, from
process start) after the build, after `initialize` and at the end.

``--reference`` is the loss without SP, engine or gradients: one process, the same model and
sequence 0 of the first step, the head's cross-entropy a slice of tokens at a time (the loss
transformers computes, without its whole logits tensor).

The helpers here (flags, model shape, batches, the timed loop) are shared with
`long_context_rank_deepspeed.py`; this module imports hf_zero only inside `train`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_memory import proc_status

SHAPE_FLAGS = [  # flag, type, default: LLaMA, ~100M parameters with the untied 32K head
    ("hidden", int, 768),
    ("intermediate", int, 2048),
    ("layers", int, 8),
    ("heads", int, 12),
    ("kv-heads", int, 4),
    ("vocab", int, 32000),
]


def parse(doc: str) -> argparse.Namespace:
    """The flags both workers take."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    for name, kind, default in [
        *SHAPE_FLAGS,
        ("seq", int, 1024),
        ("sp", int, 1),
        ("steps", int, 2),
        ("warmup", int, 1),
        ("seed", int, 0),
        ("lr", float, 1e-4),
        ("logits-tile-tokens", int, 0),  # 0: as hf_zero's "auto" (`tile_tokens`)
    ]:
        p.add_argument(f"--{name}", type=kind, default=default)
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    p.add_argument("--tiled", action="store_true", help="tiled logits and tiled MLP")
    p.add_argument("--reference", action="store_true", help="the loss without SP (one process)")
    p.add_argument("--unmap", action="store_true", help="freed buffers >= 1 MiB leave at once")
    p.add_argument("--result", type=Path, required=True)
    return p.parse_args()


def shape(args: argparse.Namespace) -> dict:
    """The LlamaConfig fields the flags set (every field `hf_zero.tiny.TINY_DECODER` sets)."""
    return dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=1 << 18,  # any length the search tries
        tie_word_embeddings=False,
    )


def build(args: argparse.Namespace) -> torch.nn.Module:
    """The model as `hf_zero.tiny.tiny_llama` builds it (``torch.manual_seed`` then the
    constructor), without importing hf_zero: DeepSpeed's worker uses it too."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    return LlamaForCausalLM(LlamaConfig(**shape(args), attn_implementation="sdpa"))


def buckets(args: argparse.Namespace) -> dict:
    """ZeRO-3 bucket sizes, the same on both engines: what the Hugging Face DeepSpeed
    integration's "auto" gives (h^2 to reduce, 0.9 h^2 to prefetch, 10 h stay whole)."""
    h2 = args.hidden * args.hidden
    return dict(
        reduce_bucket_size=h2,
        prefetch_bucket_size=int(0.9 * h2),
        param_persistence_threshold=10 * args.hidden,
    )


def tile_tokens(args: argparse.Namespace) -> int:
    """Tokens per logits tile on both engines: ``--logits-tile-tokens``, else what hf_zero's
    "auto" gives (64 MiB of fp32 logits, `hf_zero.sequence.tiles.LOGITS_TILE_BYTES`)."""
    return args.logits_tile_tokens or (64 << 20) // (4 * args.vocab)


def unmap_large_frees() -> None:
    """glibc: allocations of 1 MiB and more get their own mappings, returned to the OS when
    freed (``mallopt(M_MMAP_THRESHOLD)``, what hf_zero's ``host_memory: unmap`` sets), for
    DeepSpeed's worker, which is given the same allocator as hf_zero's at the same point."""
    import ctypes

    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)


def enable_checkpointing(model: torch.nn.Module) -> None:
    """transformers' activation checkpointing (non-reentrant, its default)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    (enable or model.gradient_checkpointing_enable)()


def sequence(args: argparse.Namespace, step: int, replica: int) -> torch.Tensor:
    """Replica ``replica``'s sequence of step ``step``: ``[1, seq]`` random tokens."""
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + replica)
    return torch.randint(0, args.vocab, (1, args.seq), generator=gen)


def timed_steps(args: argparse.Namespace, step_fn) -> dict:
    """``warmup + steps`` calls of ``step_fn(step) -> loss`` (a barrier before each); the timed
    steps' wall times and every step's loss."""
    import torch.distributed as dist

    times, losses = [], []
    for step in range(args.warmup + args.steps):
        dist.barrier()
        start = time.perf_counter()
        losses.append(float(step_fn(step)))
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    return {"step_times": times, "losses": losses}


def train(args: argparse.Namespace) -> dict:
    """hf_zero: ZeRO-3 (+ checkpointing, tiling, SP as flagged) on this rank's sequences."""
    import torch.distributed as dist

    import hf_zero
    from hf_zero.tiny import tiny_llama

    hf_zero.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = tiny_llama(args.seed, **shape(args), attn_implementation="sdpa")
    if args.checkpointing:
        enable_checkpointing(model)
    built = proc_status()["VmHWM"]
    engine = hf_zero.initialize(
        model,
        torch.optim.AdamW(model.parameters(), lr=args.lr),
        stage=3,
        sp_size=args.sp,
        tiled_logits=args.tiled,
        tiled_mlp=args.tiled,
        logits_tile_tokens=tile_tokens(args),
        host_memory="unmap" if args.unmap else "release",
        train_micro_batch_size_per_gpu=1,
        **buckets(args),
    )
    initialized = proc_status()["VmHWM"]
    replica = rank // args.sp

    def step(i: int) -> torch.Tensor:
        x = sequence(args, i, replica)
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        return loss.detach()

    record = timed_steps(args, step)
    dist.barrier()
    return {
        "status": "ok",
        "engine": "hf_zero",
        "rank": rank,
        "world": world,
        "replica": replica,
        "tokens_per_step": world // args.sp * args.seq,
        **record,
        "peak_built": built,
        "peak_initialized": initialized,
        "peak": proc_status()["VmHWM"],
    }


def reference(args: argparse.Namespace, tile: int = 1024) -> dict:
    """The first step's loss of replica 0 without SP, engine or gradients (one process)."""
    model = build(args).eval()
    x = sequence(args, 0, 0)
    labels = F.pad(x, (0, 1), value=-100)[:, 1:].reshape(-1)
    with torch.no_grad():
        hidden = model.model(input_ids=x).last_hidden_state.reshape(-1, args.hidden)
        total = sum(
            F.cross_entropy(
                model.lm_head(hidden[i : i + tile]).float(),
                labels[i : i + tile],
                ignore_index=-100,
                reduction="sum",
            )
            for i in range(0, hidden.shape[0], tile)
        )
    return {"status": "ok", "loss": float(total / (labels != -100).sum())}


def run(main, args: argparse.Namespace) -> None:
    """Run ``main(args)``, write its result (or the error) to ``--result``, exit 0 or 1."""
    try:
        out, code = main(args), 0
    except BaseException as error:
        traceback.print_exc()
        out, code = {"status": f"error: {type(error).__name__}: {error}"}, 1
    args.result.write_text(json.dumps(out))
    sys.exit(code)


if __name__ == "__main__":
    parsed = parse(__doc__)
    run(reference if parsed.reference else train, parsed)
