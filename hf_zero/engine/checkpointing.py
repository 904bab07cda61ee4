"""A `ZeroEngine`'s checkpoint: what each rank writes, and how it is read back resharded.

Layout of a checkpoint directory (safetensors and JSON only: no pickled classes)::

    zero_meta.json                  format version, world size, stage, precision, the partition
                                    map (every bucket's parameters: name, shape, offset),
                                    optimizer hyperparameters, loss scale, step counters
    zero_rank00000.safetensors      rank 0's fp32 master shards, optimizer state, RNG state
    zero_rank00001.safetensors      ...
    COMPLETE                        written last: a directory without it is not a checkpoint

Saving writes everything into ``<dir>.tmp``, fsyncs, and renames it to ``<dir>`` only after every
rank has finished, so a crash or a killed rank never leaves a half-written ``<dir>`` and never
touches an earlier checkpoint. Loading reads the partition map and, for this rank's new shard,
only the slices of the old shard files that overlap it: a checkpoint saved at one world size and
stage loads at another, with no conversion step. Frozen parameters are not part of it: they come
from the model's own weights.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from hf_zero._version import __version__
from hf_zero.checkpoint.format import FORMAT_VERSION, META, ShardReader, read_meta, shard_file
from hf_zero.checkpoint.publish import make_shared_tmp, publish, run_id
from hf_zero.comm.topology import current_device
from hf_zero.engine.save_failure import agree_on_failure
from hf_zero.storage.safetensors import Piece, pieces_nbytes, write_streamed

if TYPE_CHECKING:
    from hf_zero.engine.state_view import EngineState
    from hf_zero.sharding.flat_group import FlatParamGroup


def save_checkpoint(
    engine: EngineState, directory: str | Path, keep_last: int | None = None
) -> None:
    """Write the checkpoint atomically (collective). ``keep_last`` prunes older siblings.

    If any rank cannot write its shard (a full disk, a quota, an I/O error), every rank raises
    together: rank 0 names the folder, the bytes the save needs and the bytes free, and removes
    the partial save; the previous checkpoint is untouched."""
    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    make_shared_tmp(tmp, directory, engine.comm)
    topo = engine.topology
    pieces = _rank_pieces(engine)
    failure = None
    try:
        _write_safetensors(pieces, tmp / shard_file(topo.dp_rank, topo.tp_rank, topo.tp_size))
    except (OSError, RuntimeError) as error:
        failure = error
    agree_on_failure(engine, failure, pieces_nbytes(pieces), directory, tmp)
    if topo.rank == 0:
        publish(tmp, directory, META, _meta(engine), keep_last)
    _barrier(engine)


def _barrier(engine: EngineState) -> None:
    """Every rank of the world is here (booked in ``engine.comm_stats`` as control traffic)."""
    engine.comm.for_purpose("control").barrier(engine.topology.world)


def _rank_pieces(engine: EngineState) -> list[Piece]:
    """This rank's file as pieces: the RNG state, then one piece per group (its fp32 master
    shard and optimizer state), read only when it is written (`write_streamed`)."""
    rng = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["rng.cuda"] = torch.cuda.get_rng_state()
    pieces: list[Piece] = [(_spec(rng), lambda: rng)]
    for group in engine.groups:
        spec = {f"{group.index}.master": (torch.float32, (group.layout.shard_numel,))}
        for key, (dtype, shape) in engine.optimizer.state_spec(group).items():
            spec[f"{group.index}.state.{key}"] = (dtype, shape)
        pieces.append((spec, functools.partial(_group_tensors, engine, group)))
    return pieces


def _group_tensors(engine: EngineState, group: FlatParamGroup) -> dict[str, torch.Tensor]:
    tensors = {f"{group.index}.master": group.master_values().to("cpu", torch.float32)}
    for key, value in engine.optimizer.state_of(group).items():
        if torch.is_tensor(value):
            tensors[f"{group.index}.state.{key}"] = value
    return tensors


def _spec(tensors: dict[str, torch.Tensor]) -> dict:
    return {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}


def _meta(engine: EngineState) -> dict:
    groups = [
        {
            "index": g.index,
            "param_group": g.param_group_index,
            "num_shards": g.layout.num_shards,
            "padded_numel": g.layout.padded_numel,
            "shard_numel": g.layout.shard_numel,
            "params": [
                {"name": s.name, "offset": s.offset, "numel": s.numel, "shape": list(s.shape)}
                for s in g.layout.slots
            ],
        }
        for g in engine.groups
    ]
    param_groups = [
        {k: v for k, v in pg.items() if k != "params" and isinstance(v, (int, float, bool, tuple))}
        for pg in engine.optimizer.optimizer.param_groups
    ]
    return {
        "format_version": FORMAT_VERSION,
        "hf_zero_version": __version__,
        "run_id": run_id(engine),
        "world_size": engine.topology.dp_size,
        "tp_size": engine.topology.tp_size,
        "tp_plan": engine.tp.describe()["plan"] if engine.tp is not None else None,
        "stage": engine.config.stage,
        "precision": engine.config.precision,
        "groups": groups,
        "param_groups": param_groups,
        "loss_scaler": engine.loss_scaler.state_dict(),
        "global_steps": engine.global_steps,
        "skipped_steps": engine.skipped_steps,
    }


def _write_safetensors(pieces: list[Piece], path: Path) -> None:
    """One rank's file, written and fsynced piece by piece (the seam the fault tests cut)."""
    write_streamed(pieces, path)


# ----------------------------------------------------------------------------------------------
# loading
# ----------------------------------------------------------------------------------------------


def load_checkpoint(engine: EngineState, directory: str | Path) -> None:
    """Restore master weights, optimizer state and counters, resharding to this run's layout."""
    directory = Path(directory)
    meta = read_meta(directory)
    saved_tp = meta.get("tp_size", 1)
    if saved_tp != engine.topology.tp_size:
        raise ValueError(
            f"hf_zero: checkpoint '{directory}' was saved with 'tp_size' = {saved_tp}; this run "
            f"has tp_size = {engine.topology.tp_size}. Resume with the same tensor-parallel "
            "size (the data-parallel size may differ), or export full weights with "
            "save_pretrained and start from those"
        )
    reader = ShardReader(directory, meta, engine.topology.tp_rank)
    _check_same_model(engine, meta, directory)
    optimizer = engine.optimizer.optimizer
    state_keys = _state_keys(meta, reader)
    failure = None
    try:  # no collective until every rank has read and checked its part
        with torch.no_grad():
            for group in engine.groups:
                _load_group(group, reader, engine.optimizer, state_keys)
    except (ValueError, OSError) as error:
        failure = error
    failed = torch.tensor([failure is not None], dtype=torch.int32, device=current_device())
    engine.comm.for_purpose("control").all_reduce_max(failed, engine.topology.world)
    if failure is not None:
        raise failure
    if failed.item():
        raise ValueError(
            f"hf_zero: checkpoint '{directory}' failed to load on another rank (its error says "
            "why); nothing was resumed"
        )
    with torch.no_grad():
        for group in engine.groups:
            group.refresh_params(async_op=False)  # parameters follow the restored masters
    for param_group, saved in zip(optimizer.param_groups, meta["param_groups"]):
        for key, value in saved.items():
            param_group[key] = tuple(value) if isinstance(value, list) else value
    engine.loss_scaler.load_state_dict(meta["loss_scaler"])
    engine.global_steps = meta["global_steps"]
    engine.skipped_steps = meta["skipped_steps"]
    engine.checkpoint_run_id = meta.get("run_id") or run_id(engine)
    if meta["world_size"] == engine.topology.dp_size:
        own = reader.file(engine.topology.dp_rank)
        torch.set_rng_state(own.tensor("rng.torch"))
        if torch.cuda.is_available() and "rng.cuda" in own.header:
            torch.cuda.set_rng_state(own.tensor("rng.cuda"))


def _state_keys(meta: dict, reader: ShardReader) -> tuple[list[str], list[str]]:
    """(elementwise state keys, scalar state keys) present in the checkpoint."""
    handle = reader.file(0)
    first = meta["groups"][0]["index"] if meta["groups"] else None
    prefix = f"{first}.state."
    keys = [k[len(prefix) :] for k in handle.header if k.startswith(prefix)]
    shard = meta["groups"][0]["shard_numel"] if meta["groups"] else 0
    elementwise = [k for k in keys if handle.shape(f"{first}.state.{k}") == [shard]]
    scalars = [k for k in keys if k not in elementwise]
    return elementwise, scalars


def _load_group(group: FlatParamGroup, reader: ShardReader, optimizer, state_keys) -> None:
    elementwise, scalars = state_keys
    new_master = torch.zeros(group.layout.shard_numel, dtype=torch.float32)
    new_state: dict[str, torch.Tensor] = {}
    for piece in group.layout.shard_pieces(group.shard_index):
        name = piece.slot.name
        lo, hi = piece.shard_start, piece.shard_start + piece.numel
        new_master[lo:hi] = _finite(
            reader, name, "master", reader.read(name, "master", piece.param_start, piece.numel)
        )
        for key in elementwise:
            values = reader.read(name, f"state.{key}", piece.param_start, piece.numel)
            if values is not None:
                _finite(reader, name, f"state.{key}", values)
                if key not in new_state:  # keep the saved dtype (bf16 Adam state stays bf16)
                    new_state[key] = torch.zeros(group.layout.shard_numel, dtype=values.dtype)
                new_state[key][lo:hi] = values
    first_name = group.layout.slots[0].name
    for key in scalars:
        value = reader.scalar(first_name, f"state.{key}")
        if value is not None:
            new_state[key] = value
    optimizer.load_state_of(group, new_master, new_state)


def _finite(reader: ShardReader, name: str, key: str, values: torch.Tensor) -> torch.Tensor:
    """``values``, unless they hold NaN or Inf: a run resumed from them would train on NaN."""
    if values.is_floating_point() and not bool(torch.isfinite(values).all()):
        raise ValueError(
            f"hf_zero: checkpoint '{reader.directory}' holds NaN/Inf in '{key}' of parameter "
            f"'{name}' ({', '.join(reader.last_files)}; read on rank {dist.get_rank()}); resume "
            "from an earlier checkpoint"
        )
    return values


def _check_same_model(engine: EngineState, meta: dict, directory: Path) -> None:
    saved = {
        slot["name"]: tuple(slot["shape"]) for group in meta["groups"] for slot in group["params"]
    }
    mine = {slot.name: tuple(slot.shape) for g in engine.groups for slot in g.layout.slots}
    missing = sorted(mine.keys() - saved.keys())
    extra = sorted(saved.keys() - mine.keys())
    reshaped = sorted(n for n in mine.keys() & saved.keys() if mine[n] != saved[n])
    if missing or extra or reshaped:
        details = []
        if missing:
            details.append(f"not in the checkpoint: {missing[:8]}")
        if extra:
            details.append(f"only in the checkpoint: {extra[:8]}")
        if reshaped:
            details.append(
                "shapes differ: " + ", ".join(f"{n} {saved[n]} -> {mine[n]}" for n in reshaped[:8])
            )
        raise ValueError(
            f"hf_zero: checkpoint '{directory}' does not match this model's trainable "
            f"parameters; " + "; ".join(details)
        )
