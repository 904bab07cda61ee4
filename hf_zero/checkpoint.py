"""Sharded engine checkpoints: each rank writes and reads only its own shards.

Layout of a checkpoint directory (plain tensors and JSON, no pickled classes)::

    zero_meta.json                  format version, world size, stage, bucket layouts,
                                    optimizer hyperparameters, loss scale, step counters
    zero_rank00000.safetensors      rank 0's fp32 master shards and optimizer state
    zero_rank00001.safetensors      ...

Frozen parameters are not part of it: they come from the model's own weights. This version
loads at the same world size and stage it saved (a mismatch is a ``ValueError`` naming both);
resharding on load is listed in docs/STATUS.md as not implemented yet.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

if TYPE_CHECKING:
    from hf_zero.engine import ZeroEngine

FORMAT_VERSION = 1
META = "zero_meta.json"


def shard_file(rank: int) -> str:
    return f"zero_rank{rank:05d}.safetensors"


def save_checkpoint(engine: ZeroEngine, directory: str | Path) -> None:
    """Write this rank's shards, and (rank 0) the metadata. Collective."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    optimizer = engine.optimizer.optimizer
    tensors = {}
    for group in engine.groups:
        tensors[f"{group.index}.master"] = group.master.detach().to("cpu", copy=True)
        for key, value in optimizer.state.get(group.master, {}).items():
            if torch.is_tensor(value):
                tensors[f"{group.index}.state.{key}"] = value.detach().to("cpu", copy=True)
    save_file(tensors, str(directory / shard_file(engine.topology.rank)))
    if engine.topology.rank == 0:
        (directory / META).write_text(json.dumps(_meta(engine), indent=1))
    dist.barrier()


def load_checkpoint(engine: ZeroEngine, directory: str | Path) -> None:
    """Restore master weights, optimizer state and counters saved by `save_checkpoint`."""
    directory = Path(directory)
    meta_path = directory / META
    if not meta_path.is_file():
        raise ValueError(f"hf_zero: '{directory}' is not an hf_zero checkpoint (no {META})")
    meta = json.loads(meta_path.read_text())
    _check_compatible(engine, meta, directory)
    path = directory / shard_file(engine.topology.rank)
    if not path.is_file():
        raise ValueError(f"hf_zero: checkpoint '{directory}' has no shard file {path.name}")
    tensors = load_file(str(path))
    optimizer = engine.optimizer.optimizer
    with torch.no_grad():
        for group in engine.groups:
            group.master.copy_(tensors[f"{group.index}.master"])
            prefix = f"{group.index}.state."
            state = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
            optimizer.state[group.master] = {
                k: v.to(group.master.device) if v.dim() else v for k, v in state.items()
            }
            group.gather_params(async_op=False)  # parameters follow the restored masters
    for param_group, saved in zip(optimizer.param_groups, meta["param_groups"]):
        for key, value in saved.items():
            param_group[key] = tuple(value) if isinstance(value, list) else value
    engine.loss_scaler.load_state_dict(meta["loss_scaler"])
    engine.global_steps = meta["global_steps"]
    engine.skipped_steps = meta["skipped_steps"]


def _meta(engine: ZeroEngine) -> dict:
    groups = [
        {
            "index": g.index,
            "param_group": g.param_group_index,
            "names": g.names,
            "padded_numel": g.layout.padded_numel,
            "shard_numel": g.layout.shard_numel,
        }
        for g in engine.groups
    ]
    param_groups = [
        {k: v for k, v in pg.items() if k != "params" and isinstance(v, (int, float, bool, tuple))}
        for pg in engine.optimizer.optimizer.param_groups
    ]
    return {
        "format_version": FORMAT_VERSION,
        "world_size": engine.topology.dp_size,
        "stage": engine.config.stage,
        "precision": engine.config.precision,
        "groups": groups,
        "param_groups": param_groups,
        "loss_scaler": engine.loss_scaler.state_dict(),
        "global_steps": engine.global_steps,
        "skipped_steps": engine.skipped_steps,
    }


def _check_compatible(engine: ZeroEngine, meta: dict, directory: Path) -> None:
    if meta.get("format_version", 0) > FORMAT_VERSION:
        raise ValueError(
            f"hf_zero: checkpoint '{directory}' has format_version {meta['format_version']}; this "
            f"version reads up to {FORMAT_VERSION}: upgrade hf_zero"
        )
    expected = {"world_size": engine.topology.dp_size, "stage": engine.config.stage}
    for key, value in expected.items():
        if meta[key] != value:
            raise ValueError(
                f"hf_zero: checkpoint '{directory}' was saved with {key} = {meta[key]}, this run "
                f"has {key} = {value}; resume with {key} = {meta[key]} (resharding on load is not "
                "implemented yet)"
            )
    saved = [(g["names"], g["padded_numel"]) for g in meta["groups"]]
    mine = [(g.names, g.layout.padded_numel) for g in engine.groups]
    if saved != mine:
        missing = sorted({n for names, _ in saved for n in names} - {n for g in mine for n in g[0]})
        extra = sorted({n for g in mine for n in g[0]} - {n for names, _ in saved for n in names})
        raise ValueError(
            f"hf_zero: checkpoint '{directory}' does not match this model's buckets; parameters "
            f"only in the checkpoint: {missing[:5]}, only in the model: {extra[:5]} (same model, "
            "optimizer param groups and reduce_bucket_size are needed)"
        )
