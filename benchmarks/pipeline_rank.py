"""One rank of benchmarks/bench_pipeline.py: hf_zero's pipeline engine on a LLaMA-shaped model.

Launched by `common.launch_ranks` (one process per rank, gloo). Per timed step it records the
wall time of ``train_batch`` (schedule, reduction, optimizer step), of the schedule alone (its
``step`` call), the time this rank's stages spent computing inside it
(`forward_one_chunk` / `backward_one_chunk`), and the peak bytes of tensors autograd saved
for backward inside the stages (activations), via `torch.autograd.graph.saved_tensors_hooks`.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
from common import llama_shape
from torch.distributed.pipelining import schedules
from torch.distributed.pipelining import stage as pipelining_stage
from transformers import LlamaConfig, LlamaForCausalLM

import hf_zero
from hf_zero.comm.topology import init_distributed


class Meter:
    """Compute time of the stage chunks, the bytes sent point to point, and the activations
    autograd saved, alive and at their peak: each storage counted once while any saved tensor
    uses it, parameters (which autograd saves too) not at all."""

    def __init__(self) -> None:
        self.busy = 0.0
        self.schedule = 0.0
        self.sent = 0
        self.alive = 0
        self.peak = 0
        self.users: dict[int, int] = {}
        self.params: set[int] = set()

    def timed(self, fn, into: str):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, into, getattr(self, into) + time.perf_counter() - start)

        return run

    def sending(self, get_ops):
        def ops(*args, **kwargs):
            found = get_ops(*args, **kwargs)
            self.sent += sum(op.tensor.numel() * op.tensor.element_size() for op in found)
            return found

        return ops

    def pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if key in self.params or nbytes == 0:
            return (tensor, None)
        meter = self

        class Held:  # freed with the graph: the storage stops counting with its last user
            def __del__(self) -> None:
                meter.users[key] -= 1
                if not meter.users[key]:
                    del meter.users[key]
                    meter.alive -= nbytes

        if key not in self.users:
            self.users[key] = 0
            self.alive += nbytes
            self.peak = max(self.peak, self.alive)
        self.users[key] += 1
        return (tensor, Held())

    @staticmethod
    def unpack(packed):
        return packed[0]


def main() -> None:
    p = argparse.ArgumentParser()
    for name, default in [("--pp", 2), ("--microbatches", 4), ("--micro-batch-size", 2),
                          ("--seq", 128), ("--hidden", 256), ("--layers", 4), ("--vocab", 1024),
                          ("--steps", 5), ("--warmup", 2), ("--seed", 0), ("--zero-stage", 1)]:  # fmt: skip
        p.add_argument(name, type=int, default=default)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--result", required=True)
    args = p.parse_args()

    torch.manual_seed(args.seed)
    shape = llama_shape(args.hidden, args.layers, args.vocab, args.seq)
    model = LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=False))
    meter = Meter()
    for name in ("forward_one_chunk", "backward_one_chunk"):
        cls = pipelining_stage._PipelineStageBase
        setattr(cls, name, meter.timed(getattr(cls, name), "busy"))
    for cls in (schedules.ScheduleGPipe, schedules.Schedule1F1B, schedules.ScheduleInterleaved1F1B):
        cls.step = meter.timed(cls.step, "schedule")
    for name in ("get_fwd_send_ops", "get_bwd_send_ops"):  # activations and their gradients
        cls = pipelining_stage._PipelineStageBase
        setattr(cls, name, meter.sending(getattr(cls, name)))
    if args.pp == 1:
        return data_parallel(args, model, meter)
    engine = hf_zero.initialize(
        model,
        torch.optim.AdamW(model.parameters(), lr=args.lr),
        pp_size=args.pp,
        pp_schedule=args.schedule,
        pp_microbatches=args.microbatches,
        stage=args.zero_stage,
    )
    meter.params = {p.untyped_storage().data_ptr() for p in model.parameters() if p.numel()}
    for stage in engine.stages:  # count what autograd saves inside the stage's forward
        forward = stage.forward

        def saving(*a, _forward=forward, **k):
            with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
                return _forward(*a, **k)

        stage.forward = saving
    gen = torch.Generator().manual_seed(args.seed)
    rows = args.microbatches * args.micro_batch_size
    step_times, schedule_times, busy, losses = [], [], [], []
    for step in range(args.warmup + args.steps):
        ids = torch.randint(0, args.vocab, (rows, args.seq), generator=gen)
        meter.busy = meter.schedule = 0.0
        dist.barrier()
        start = time.perf_counter()
        losses.append(engine.train_batch({"input_ids": ids}))
        total = time.perf_counter() - start
        if step >= args.warmup:
            step_times.append(total)
            schedule_times.append(meter.schedule)
            busy.append(meter.busy)
    result = {
        "rank": dist.get_rank(),
        "pp_rank": engine.topology.pp_rank,
        "step_times": step_times,
        "schedule_times": schedule_times,
        "busy_times": busy,
        "losses": losses,
        "peak_saved_bytes": meter.peak,
        "sent_bytes_per_step": meter.sent / (args.warmup + args.steps),
        "memory": engine.memory_report(),
        "stage_layers": [len(s.layers) for s in engine.stages],
    }
    finish(args, result)


def finish(args, result: dict) -> None:
    with open(args.result, "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def data_parallel(args, model, meter: Meter) -> None:
    """The baseline: the same model whole on every rank, ZeRO-1 over them (``--pp 1``); each
    rank accumulates its share of the step's micro-batches."""
    init_distributed()
    world, rank = dist.get_world_size(), dist.get_rank()
    local = args.microbatches // world
    engine = hf_zero.initialize(
        model,
        torch.optim.AdamW(model.parameters(), lr=args.lr),
        stage=args.zero_stage,
        gradient_accumulation_steps=local,  # reduce once per step, as the pipeline does
    )
    meter.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    gen = torch.Generator().manual_seed(args.seed)
    rows = args.microbatches * args.micro_batch_size
    step_times, losses = [], []
    for step in range(args.warmup + args.steps):
        ids = torch.randint(0, args.vocab, (rows, args.seq), generator=gen)
        mine = ids.chunk(world)[rank].chunk(local)
        dist.barrier()
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            for chunk in mine:
                loss = engine(input_ids=chunk, labels=chunk).loss
                engine.backward(loss)  # scaled by 1 / local
        engine.step()
        total = time.perf_counter() - start
        losses.append(loss.item())
        if step == 0:
            sent_before = engine.comm_stats.wire_bytes()
        if step >= args.warmup:
            step_times.append(total)
    sent = (engine.comm_stats.wire_bytes() - sent_before) / (args.warmup + args.steps - 1)
    result = {
        "rank": rank, "pp_rank": 0, "step_times": step_times, "losses": losses,
        "peak_saved_bytes": meter.peak, "sent_bytes_per_step": sent,
        "memory": engine.memory_report(),
    }  # fmt: skip
    finish(args, result)


if __name__ == "__main__":
    main()
