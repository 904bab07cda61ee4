"""One rank of DeepSpeed's ALST (Ulysses SP for HF Transformers) on the model of
`long_context_rank.py`: the reference point of benchmarks/bench_long_context.py.

The recipe of DeepSpeed's tutorial "Arctic Long Sequence Training (ALST) for HF Transformers"
and ArcticTraining's SFT trainer, on CPU (gloo, ``DS_ACCELERATOR=cpu``): the same model, seed,
flags and batches as the hf_zero worker (`long_context_rank.build`, `sequence`); ZeRO-3, fp32,
micro-batch 1, ``torch.optim.AdamW`` (``zero_allow_untested_optimizer``), the same bucket sizes
(`long_context_rank.buckets`).

* ``--sp N``: `UlyssesSPAttentionHF.register_with_transformers` (sdpa) makes the groups (the
  ``mpu`` handed to ``deepspeed.initialize``); `UlyssesSPDataLoaderAdapter` shards each batch
  along the sequence and pre-shifts its labels. Every rank of a group feeds sequences of its
  replica: the adapter trains the group's batches one after the other, so sp-rank ``k`` feeds
  step ``r * N + k``'s sequence at its ``r``-th refill and step ``i`` trains ``sequence(i, d)``
  as on hf_zero. Each rank's loss (the mean over its slice) is combined over the group by the
  tutorial's differentiable all-gather, weighted by each rank's count of non-ignored labels.
* ``--checkpointing``: transformers' activation checkpointing (as on hf_zero).
* ``--tiled``: `TiledMLP` patched into ``LlamaMLP.forward`` (``ceil(seq / hidden)`` shards, the
  max over ranks, as the tutorial) and the head + loss through `TiledFusedLogitsLoss` as
  ArcticTraining computes it, with as many tokens per shard as hf_zero's logits tiles
  (`long_context_rank.tile_tokens`; ArcticTraining's own default is 1 GiB of logits).

Writes the same result fields as the hf_zero worker.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_memory import proc_status
from long_context_rank import (
    buckets,
    build,
    enable_checkpointing,
    parse,
    run,
    sequence,
    tile_tokens,
    timed_steps,
    unmap_large_frees,
)


def tile_mlp() -> None:
    """``LlamaMLP.forward`` through DeepSpeed's `TiledMLP` (the tutorial's monkey patch)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP
    from transformers.models.llama import modeling_llama

    def mlp_forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    def tiled_forward(self, x):
        shards = torch.tensor(math.ceil(x.shape[-2] / x.shape[-1]))
        dist.all_reduce(shards, op=dist.ReduceOp.MAX)  # every rank the same number of shards
        params = [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight]
        return TiledMLP.apply(mlp_forward, self, x, int(shards.item()), params)

    modeling_llama.LlamaMLP.forward = tiled_forward


def tiled_loss(module, hidden: torch.Tensor, shift_labels: torch.Tensor, tile: int):
    """ArcticTraining's tiled head + cross-entropy: the sum over shards of each shard's loss
    times its count of non-ignored labels, divided by this rank's count."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

    def loss_fn(model, hidden_states, labels):
        logits = model.lm_head(hidden_states)
        if bool((labels == -100).all()):
            return (logits.sum() * 0.0).float()
        good = (labels != -100).sum()
        loss = model.loss_function(
            logits=logits, labels=None, vocab_size=model.config.vocab_size, shift_labels=labels
        )
        return loss * good

    shards = math.ceil(shift_labels.shape[1] / tile)
    total = TiledFusedLogitsLoss.apply(
        loss_fn, module, hidden, shift_labels, None, shards, [module.lm_head.weight], "sum"
    )
    return total / max((shift_labels != -100).sum(), 1)


def group_loss(loss: torch.Tensor, shift_labels: torch.Tensor, group, size: int):
    """The tutorial's differentiable, label-count-weighted loss over the SP group."""
    import torch.distributed.nn.functional as dist_fn

    losses = dist_fn.all_gather(loss, group=group)
    good = dist_fn.all_gather((shift_labels != -100).view(-1).sum(), group=group)
    return sum(losses[r] * good[r] for r in range(size)) / sum(good)


def train(args) -> dict:
    """DeepSpeed ZeRO-3 (+ ALST's pieces as flagged) on this rank's sequences."""
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import (
        UlyssesSPAttentionHF,
        UlyssesSPDataLoaderAdapter,
    )
    from deepspeed.utils import groups

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(args)
    if args.checkpointing:
        enable_checkpointing(model)
    if args.tiled:
        tile_mlp()
    built = proc_status()["VmHWM"]
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model,
        core_attn_implementation="sdpa",
        sequence_parallel_size=args.sp,
        micro_batch_size=1,
        seq_length=args.seq,
        seq_length_is_variable=True,
    )
    size = buckets(args)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": size["reduce_bucket_size"],
            "stage3_prefetch_bucket_size": size["prefetch_bucket_size"],
            "stage3_param_persistence_threshold": size["param_persistence_threshold"],
        },
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if args.sp > 1:
        config["sequence_parallel_size"] = args.sp
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if args.unmap:
        unmap_large_frees()
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, mpu=mpu)
    initialized = proc_status()["VmHWM"]
    replica = rank // args.sp
    steps = args.warmup + args.steps
    if args.sp > 1:
        group, sp_rank = groups._get_sequence_parallel_group(), groups._get_sequence_parallel_rank()
        mine = [
            dict(input_ids=x, labels=x.clone(), position_ids=torch.arange(args.seq)[None])
            for x in (
                sequence(args, r * args.sp + sp_rank, replica)
                for r in range(math.ceil(steps / args.sp))
            )
        ]
        batches = iter(
            UlyssesSPDataLoaderAdapter(
                mine, sp_rank=sp_rank, sp_group=group, sp_world_size=args.sp, device="cpu"
            )
        )

    def next_batch(i: int) -> dict:
        if args.sp > 1:
            return next(batches)
        x = sequence(args, i, replica)
        shift = torch.nn.functional.pad(x, (0, 1), value=-100)[:, 1:]
        return dict(input_ids=x, position_ids=torch.arange(args.seq)[None], shift_labels=shift)

    def step(i: int) -> torch.Tensor:
        batch = next_batch(i)
        shift = batch["shift_labels"]
        inputs = dict(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
        module = engine.module
        if args.tiled:
            hidden = module.model(**inputs, use_cache=False).last_hidden_state
            loss = tiled_loss(module, hidden, shift, tile_tokens(args))
        else:
            logits = engine(**inputs, use_cache=False).logits
            loss = module.loss_function(
                logits=logits, labels=None, vocab_size=args.vocab, shift_labels=shift
            )
        if args.sp > 1:
            loss = group_loss(loss, shift, group, args.sp)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    record = timed_steps(args, step)
    peak = proc_status()["VmHWM"]
    dist.barrier()
    dist.destroy_process_group()  # without it a rank may abort at exit (std::terminate)
    return {
        "status": "ok",
        "engine": "deepspeed",
        "deepspeed": deepspeed.__version__,
        "rank": rank,
        "world": world,
        "replica": replica,
        "tokens_per_step": world // args.sp * args.seq,
        **record,
        "peak_built": built,
        "peak_initialized": initialized,
        "peak": peak,
    }


if __name__ == "__main__":
    run(train, parse(__doc__))
