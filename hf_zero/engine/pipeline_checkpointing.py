"""What a `PipelineEngine` writes into a checkpoint and reads back, at any pp/dp layout and ZeRO
stage with the same ``tp_size`` (the format: `hf_zero.checkpoint.pipeline_format`). Written into
``<dir>.tmp`` and published by one rename (`hf_zero.checkpoint.publish`), so a failed save never
damages the previous one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from hf_zero.checkpoint.pipeline_format import (
    FORMAT,
    META,
    VERSION,
    StageFiles,
    read_meta,
    stage_file,
)
from hf_zero.checkpoint.publish import make_shared_tmp, publish, run_id

if TYPE_CHECKING:
    from hf_zero.engine.pipeline_engine import PipelineEngine


# --- saving -----------------------------------------------------------------------------------
def save_checkpoint(engine: PipelineEngine, directory: str | Path, keep_last: int | None) -> None:
    """Write ``directory`` atomically (collective over every rank)."""
    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    topo = engine.topology
    make_shared_tmp(tmp, directory, engine.comm)
    tensors = _named_tensors(engine)  # collective over the data-parallel group
    if topo.dp_rank == 0:
        path = tmp / stage_file(topo.pp_rank, topo.tp_rank)
        save_file(tensors, str(path))
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    names = sorted(n.split("/", 1)[1] for n in tensors if n.startswith("param/"))
    listing = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object((stage_file(topo.pp_rank, topo.tp_rank), names), listing, dst=0)
    dist.barrier()  # every file is on disk; a rank that died never gets past here
    if dist.get_rank() == 0:
        publish(tmp, directory, META, _meta(engine, dict(listing)), keep_last)
    dist.barrier()


def _named_tensors(engine: PipelineEngine) -> dict[str, torch.Tensor]:
    """``param/<name>`` and ``state/<name>/<key>`` for this rank's parameters (the tied head's
    copy left out: it equals the embedding, value and state)."""
    names = {id(p): n for n, p in engine.module.named_parameters()}
    opt = engine.stage_optimizer
    out: dict[str, torch.Tensor] = {}
    for p in engine.stage_parameters():
        if id(p) in names:
            out[f"param/{names[id(p)]}"] = p.detach().float().cpu().contiguous()
    for flat in opt.flats:
        if flat is None:
            continue
        if opt.stage == 0:
            per_param = [engine.optimizer.state.get(p, {}) for p in flat.params]
        else:
            per_param = _unflatten_state(engine, flat)
        for p, state in zip(flat.params, per_param):
            if id(p) not in names:
                continue
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    value = value.detach().reshape(p.shape) if value.dim() else value.reshape(1)
                    out[f"state/{names[id(p)]}/{key}"] = value.float().cpu().clone()
    return out


def _unflatten_state(engine: PipelineEngine, flat) -> list[dict[str, torch.Tensor]]:
    """ZeRO-1/2: each state tensor's shards all-gathered over the replicas, cut per parameter."""
    state = engine.optimizer.state.get(flat.master, {})
    per_param: list[dict[str, torch.Tensor]] = [{} for _ in flat.params]
    for key in sorted(state):
        value = state[key]
        if not isinstance(value, torch.Tensor):
            continue
        if value.dim() == 0:  # the step counter: the same for every parameter of the group
            for entry in per_param:
                entry[key] = value
            continue
        full = torch.empty(flat.layout.padded_numel, dtype=value.dtype, device=value.device)
        engine.comm.all_gather(full, value.contiguous(), engine.topology.dp)
        for entry, slot in zip(per_param, flat.layout.slots):
            entry[key] = full[slot.offset : slot.end]
    return per_param


def _meta(engine: PipelineEngine, files: dict[str, list[str]]) -> dict:
    topo, config = engine.topology, engine.config
    groups = [
        {k: v for k, v in g.items() if k != "params" and isinstance(v, (int, float, bool, str))}
        for g in engine.optimizer.param_groups
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
        "model_class": type(engine.module).__name__,
        "tied_embeddings": bool(engine.tied),
        "param_groups": groups,
        "lr_scheduler": scheduler,
        "tp_shards": tp_shards,
        "files": {f: files[f] for f in sorted(files)},
    }


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

    with torch.no_grad():
        for p in engine.stage_parameters():
            value = files.get(f"param/{name_of(p)}")
            if value is None or tuple(value.shape) != tuple(p.shape):
                found = None if value is None else tuple(value.shape)
                raise ValueError(
                    f"hf_zero pipeline: checkpoint '{directory}' has no parameter "
                    f"'{name_of(p)}' of shape {tuple(p.shape)} (found {found}): it was saved "
                    f"from another model ({meta['model_class']})"
                )
            p.copy_(value)
    engine.stage_optimizer.copy_params_to_master()
    _load_optimizer(engine, files, name_of)
    for group, saved in zip(engine.optimizer.param_groups, meta["param_groups"]):
        group.update(saved)
    if engine.lr_scheduler is not None and meta["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(meta["lr_scheduler"])
    engine.global_steps = meta["global_steps"]


def _load_optimizer(engine: PipelineEngine, files: StageFiles, name_of) -> None:
    opt = engine.stage_optimizer
    engine.optimizer.state.clear()
    for flat in opt.flats:
        if flat is None:
            continue
        states = [files.state(name_of(p)) for p in flat.params]
        if opt.stage == 0:
            for p, state in zip(flat.params, states):
                if state:
                    engine.optimizer.state[p] = {
                        k: (v.reshape(()) if k == "step" else v.to(p.device))
                        for k, v in state.items()
                    }
            continue
        keys = set().union(*states)
        shard: dict[str, torch.Tensor] = {}
        start, end = flat.layout.shard_range(opt.dp_index)
        for key in sorted(keys):
            if key == "step":
                shard[key] = states[0][key].reshape(())
                continue
            whole = opt.flatten([s.get(key) for s in states], flat.layout)
            shard[key] = whole[start:end].clone().to(flat.master.device)
        if shard:
            engine.optimizer.state[flat.master] = shard
