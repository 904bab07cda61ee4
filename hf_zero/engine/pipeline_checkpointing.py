"""What a `PipelineEngine` writes into a checkpoint and reads back, at any pp/dp layout and ZeRO
stage with the same ``tp_size`` (the format: `hf_zero.checkpoint.pipeline_format`). Written into
``<dir>.tmp`` and published by one rename (`hf_zero.checkpoint.publish`), so a failed save never
damages the previous one; a save that fails on one rank fails on every rank together.

Each stage file is written by the stage's first data-parallel rank one flat group at a time
(`write_streamed`, a CRC-32 per block of every tensor): a group's sharded optimizer state is
all-gathered over the stage's replicas, cut per parameter and written, so at most one group's
state is whole in memory (under ``offload_optimizer: nvme`` it is read from its swap files then).
Every read is checked against those checksums, and a value that is NaN or Inf is refused.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from hf_zero.checkpoint.pipeline_format import (
    FORMAT,
    META,
    VERSION,
    StageFiles,
    read_meta,
    stage_file,
)
from hf_zero.checkpoint.publish import make_shared_tmp, publish, run_id
from hf_zero.engine.save_failure import agree_on_failure
from hf_zero.storage.safetensors import Piece, pieces_nbytes, write_streamed

if TYPE_CHECKING:
    from hf_zero.engine.pipeline_engine import PipelineEngine
    from hf_zero.sharding.flat_group import FlatParamGroup


# --- saving -----------------------------------------------------------------------------------
def save_checkpoint(engine: PipelineEngine, directory: str | Path, keep_last: int | None) -> None:
    """Write ``directory`` atomically (collective over every rank)."""
    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    topo = engine.topology
    make_shared_tmp(tmp, directory, engine.comm)
    names = {id(p): n for n, p in engine.module.named_parameters()}
    pieces = _stage_pieces(engine, names)
    path = tmp / stage_file(topo.pp_rank, topo.tp_rank)
    failure = _write(pieces, path, writer=topo.dp_rank == 0)
    nbytes = pieces_nbytes(pieces) if topo.dp_rank == 0 else 0
    agree_on_failure(engine, failure, nbytes, directory, tmp)
    saved = sorted(n.split("/", 1)[1] for spec, _ in pieces for n in spec if n.startswith("param/"))
    listing = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object((stage_file(topo.pp_rank, topo.tp_rank), saved), listing, dst=0)
    if dist.get_rank() == 0:
        publish(tmp, directory, META, _meta(engine, dict(listing)), keep_last)
    dist.barrier()


def _write(pieces: list[Piece], path: Path, writer: bool) -> Exception | None:
    """The writer streams ``pieces`` into ``path``; the stage's other replicas produce them too,
    for the all-gathers inside. A failed write still produces the remaining pieces, so that
    the replicas' collectives complete and every rank can learn of the failure."""
    produced = []

    def counted(produce):
        produced.append(produce)
        return produce()

    tracked = [(spec, functools.partial(counted, produce)) for spec, produce in pieces]
    failure = None
    if writer:
        try:
            write_streamed(tracked, path)
        except (OSError, RuntimeError) as error:
            failure = error
    for _, produce in pieces[len(produced) :]:
        produce()
    return failure


def _stage_pieces(engine: PipelineEngine, names: dict[int, str]) -> list[Piece]:
    """This rank's stage file as pieces: parameters outside the groups (frozen ones), then one
    piece per group: ``param/<name>`` and ``state/<name>/<key>`` for each of its parameters
    (the tied head's copy left out: it equals the embedding, value and state)."""
    grouped = {id(p) for g in engine.groups for p in g.params}
    loose = {
        f"param/{names[id(p)]}": p
        for p in engine.stage_parameters()
        if id(p) not in grouped and id(p) in names
    }
    pieces: list[Piece] = [
        (
            {n: (torch.float32, tuple(p.shape)) for n, p in loose.items()},
            lambda: {n: p.detach().float().cpu() for n, p in loose.items()},
        )
    ]
    for group in engine.groups:
        spec = {}
        state_spec = engine.optimizer.state_spec(group)
        for slot, p in zip(group.layout.slots, group.params):
            if id(p) not in names:
                continue
            spec[f"param/{names[id(p)]}"] = (torch.float32, tuple(slot.shape))
            for key, (_, shape) in state_spec.items():
                spec[f"state/{names[id(p)]}/{key}"] = (torch.float32, _saved_shape(shape, slot))
        pieces.append((spec, functools.partial(_group_tensors, engine, group, names)))
    return pieces


def _saved_shape(shape: tuple, slot) -> tuple:
    """A state tensor per parameter: elementwise ones in the parameter's shape, a scalar (the
    step counter) as one element."""
    return tuple(slot.shape) if len(shape) else (1,)


def _group_tensors(
    engine: PipelineEngine, group: FlatParamGroup, names: dict[int, str]
) -> dict[str, torch.Tensor]:
    """One group's parameters (its fp32 master weights) and optimizer state per parameter
    (collective over the stage's replicas: the shards are all-gathered)."""
    out = {}
    master = group.full_master()  # fp32 whatever the training precision
    for slot, p in zip(group.layout.slots, group.params):
        if id(p) in names:
            out[f"param/{names[id(p)]}"] = master[slot.offset : slot.end].view(slot.shape).cpu()
    for key, value in sorted(engine.optimizer.state_of(group).items()):
        if not torch.is_tensor(value):
            continue
        if value.dim():
            whole = value
            if group.layout.num_shards > 1:
                whole = torch.empty(
                    group.layout.padded_numel, dtype=value.dtype, device=value.device
                )
                engine.comm.all_gather(whole, value.contiguous(), group.shard_group)
        for slot, p in zip(group.layout.slots, group.params):
            if id(p) in names:
                cut = whole[slot.offset : slot.end].view(slot.shape) if value.dim() else value
                out[f"state/{names[id(p)]}/{key}"] = (
                    cut.reshape(_saved_shape(tuple(value.shape), slot)).float().cpu()
                )
    return out


def _meta(engine: PipelineEngine, files: dict[str, list[str]]) -> dict:
    topo, config = engine.topology, engine.config
    groups = [
        {k: v for k, v in g.items() if k != "params" and isinstance(v, (int, float, bool, str))}
        for g in engine.optimizer.optimizer.param_groups
    ]
    scheduler = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
    try:
        json.dumps(scheduler)
    except TypeError:
        scheduler = None  # holds functions (LambdaLR): rebuilt by the script, as it was built
    tp_shards = {}
    if engine.tp is not None:
        for name, p in engine.module.named_parameters():
            shard = engine.tp.shard_of(p)
            if shard is not None:
                tp_shards[name] = [shard.dim, shard.parts]
    return {
        "format": FORMAT,
        "run_id": run_id(engine),
        "format_version": VERSION,
        "pp_size": topo.pp_size,
        "dp_size": topo.dp_size,
        "tp_size": topo.tp_size,
        "stage": config.stage,
        "pp_schedule": config.pp_schedule,
        "global_steps": engine.global_steps,
        "loss_scaler": engine.loss_scaler.state_dict(),
        "model_class": type(engine.module).__name__,
        "tied_embeddings": bool(engine.tied),
        "param_groups": groups,
        "lr_scheduler": scheduler,
        "tp_shards": tp_shards,
        "files": {f: files[f] for f in sorted(files)},
    }


# --- loading ----------------------------------------------------------------------------------
def load_checkpoint(engine: PipelineEngine, directory: str | Path) -> None:
    """Load parameters, optimizer state, step counter and scheduler saved at any pp/dp layout
    and ZeRO stage with the same ``tp_size``."""
    directory = Path(directory)
    meta = read_meta(directory)
    topo = engine.topology
    if meta["tp_size"] != topo.tp_size:
        raise ValueError(
            f"hf_zero pipeline: checkpoint '{directory}' was saved with 'tp_size' = "
            f"{meta['tp_size']}; this run has tp_size {topo.tp_size}. Pipeline checkpoints load "
            "at any pp_size, data-parallel size or ZeRO stage, but only at the same tp_size"
        )
    files = StageFiles(directory, meta, topo.tp_rank)
    engine.checkpoint_run_id = meta.get("run_id") or run_id(engine)
    names = {id(p): n for n, p in engine.module.named_parameters()}
    embed_name = names.get(id(engine.module.get_input_embeddings().weight))

    def name_of(p: torch.nn.Parameter) -> str:
        return embed_name if p is engine.tied_copy else names[id(p)]

    def value_of(p: torch.nn.Parameter) -> torch.Tensor:
        value = files.get(f"param/{name_of(p)}")
        if value is None or tuple(value.shape) != tuple(p.shape):
            found = None if value is None else tuple(value.shape)
            raise ValueError(
                f"hf_zero pipeline: checkpoint '{directory}' has no parameter "
                f"'{name_of(p)}' of shape {tuple(p.shape)} (found {found}): it was "
                f"saved from another model ({meta['model_class']})"
            )
        return value

    failure = None
    try:  # no collective until every rank has read and checked its part
        with torch.no_grad():
            grouped = set()
            for group in engine.groups:  # one group's fp32 values in memory at a time
                values = [value_of(p) for p in group.params]
                for p, value in zip(group.params, values):
                    p.copy_(value)
                    grouped.add(id(p))
                states = [files.state(name_of(p)) for p in group.params]
                _load_group(engine, group, values, states)
            for p in engine.stage_parameters():
                if id(p) not in grouped:
                    p.copy_(value_of(p))
    except (ValueError, OSError) as error:
        failure = error
    failed = torch.tensor([failure is not None], dtype=torch.int32, device=engine.device)
    engine.comm.for_purpose("control").all_reduce_max(failed, topo.world)
    if failure is not None:
        raise failure
    if failed.item():
        raise ValueError(
            f"hf_zero pipeline: checkpoint '{directory}' failed to load on another rank (its "
            "error says why); nothing was resumed"
        )
    for group, saved in zip(engine.optimizer.optimizer.param_groups, meta["param_groups"]):
        group.update(saved)
    if engine.lr_scheduler is not None and meta["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(meta["lr_scheduler"])
    engine.global_steps = meta["global_steps"]
    if "loss_scaler" in meta:  # not in checkpoints written before fp16 stages existed
        engine.loss_scaler.load_state_dict(meta["loss_scaler"])


def _load_group(
    engine: PipelineEngine, group: FlatParamGroup, values: list[torch.Tensor], states: list[dict]
) -> None:
    """``group``'s master shard and its optimizer state shard, laid out from the saved
    per-parameter fp32 ``values`` and ``states`` (a parameter without state gets zeros)."""
    start, end = group.layout.shard_range(group.shard_index)
    shard: dict[str, torch.Tensor] = {}
    for key in sorted(set().union(*states)):
        if key == "step":  # the same for every parameter of a group
            shard[key] = next(s[key] for s in states if key in s).reshape(())
            continue
        whole = torch.zeros(group.layout.padded_numel, dtype=torch.float32)
        for slot, state in zip(group.layout.slots, states):
            if key in state:
                whole[slot.offset : slot.end] = state[key].reshape(-1)
        shard[key] = whole[start:end].clone()
    whole = torch.zeros(group.layout.padded_numel, dtype=torch.float32)
    for slot, value in zip(group.layout.slots, values):
        whole[slot.offset : slot.end] = value.reshape(-1)
    engine.optimizer.load_state_of(group, whole[start:end].clone(), shard)
