"""Publishing a checkpoint folder atomically, and finding the newest complete one.

Every rank writes into ``<dir>.tmp``; rank 0 checks first that all ranks see that one folder
(`make_shared_tmp`), and once every file is there writes the metadata and the ``COMPLETE`` marker,
fsyncs, and renames ``<dir>.tmp`` to ``<dir>`` (`publish`). A crash or a killed rank therefore
never leaves a half-written ``<dir>`` and never touches an earlier checkpoint. The engines decide
what goes into the folder (`hf_zero.engine.checkpointing`, `hf_zero.engine.pipeline_checkpointing`).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
import uuid
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from hf_zero.checkpoint.format import MARKER, META, is_complete
from hf_zero.comm.topology import Group, current_device

if TYPE_CHECKING:
    from hf_zero.comm import Collectives


def make_shared_tmp(tmp: Path, directory: Path, comm: Collectives) -> None:
    """Rank 0 creates ``tmp`` (emptied); then every rank writes a probe file there and rank 0
    checks that it sees them all (collective over every rank, booked as control traffic).
    Checkpoints are one directory that every rank writes into and rank 0 publishes; on nodes
    that do not share it, say so now, on every rank, before anything is written or published."""
    rank, world = dist.get_rank(), dist.get_world_size()
    everyone = Group(None, tuple(range(world)), False)
    control = comm.for_purpose("control")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    control.barrier(everyone)
    probe = tmp / f".probe-rank{rank}"
    if tmp.is_dir():
        probe.write_text(socket.gethostname())
    control.barrier(everyone)
    seen = torch.ones(world, dtype=torch.uint8, device=current_device())
    if rank == 0:
        for r in range(world):
            seen[r] = int((tmp / f".probe-rank{r}").exists())
    control.broadcast(seen, 0, everyone)
    missing = [r for r, ok in enumerate(seen.tolist()) if not ok]
    if missing:
        node = os.environ.get("GROUP_RANK")
        raise ValueError(
            f"hf_zero checkpoint: '{directory}' is not one directory every rank shares: rank 0 "
            f"does not see the files ranks {missing} write there. Save to a filesystem that "
            "every node mounts at the same path (NFS, Lustre, a shared volume); the previous "
            f"checkpoint, if any, is untouched. (This rank: host {socket.gethostname()}"
            + (f", node {node}" if node is not None else "")
            + ")"
        )
    control.barrier(everyone)
    probe.unlink(missing_ok=True)


def publish(tmp: Path, directory: Path, meta_name: str, meta: dict, keep_last: int | None) -> None:
    """Rank 0, once every rank's files are in ``tmp``: write the metadata and the marker, then
    put ``tmp`` in ``directory``'s place (the previous checkpoint stays whole until the rename)
    and prune older siblings to ``keep_last``."""
    _write_text(tmp / meta_name, json.dumps(meta, indent=1))
    _write_text(tmp / MARKER, time.strftime("%Y-%m-%dT%H:%M:%S"))
    fsync_path(tmp)
    old = directory.with_name(directory.name + ".old")
    if directory.exists():
        shutil.rmtree(old, ignore_errors=True)
        directory.rename(old)
    tmp.rename(directory)
    fsync_path(directory.parent)
    shutil.rmtree(old, ignore_errors=True)
    if keep_last:
        _rotate(directory, keep_last, meta_name, meta.get("run_id"))


def _write_text(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def fsync_path(path: Path) -> None:
    """Flush a file's data, or a folder's entries (a rename into it), to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def run_id(engine) -> str:
    """This run's id, written into its checkpoints' metadata (a resumed run takes the id of
    the checkpoint it resumed from): ``keep_last`` prunes only checkpoints of the same run."""
    return engine.__dict__.setdefault("checkpoint_run_id", uuid.uuid4().hex)


def _rotate(directory: Path, keep_last: int, meta_name: str, run: str | None) -> None:
    def same_run(d: Path) -> bool:
        try:
            return json.loads((d / meta_name).read_text()).get("run_id") == run
        except (OSError, ValueError):
            return False

    siblings = [
        d
        for d in directory.parent.iterdir()
        if d.is_dir() and is_complete(d) and (d / meta_name).is_file() and same_run(d)
    ]
    siblings.sort(key=lambda d: (d / MARKER).stat().st_mtime)
    for old in siblings[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(parent: str | Path) -> Path | None:
    """The newest complete checkpoint directory under ``parent``; incomplete ones are skipped
    with a warning naming them."""
    found = []
    for d in Path(parent).iterdir():
        if not d.is_dir():
            continue
        if is_complete(d):
            found.append(d)
        elif (d / META).exists() or any(d.glob("zero_rank*.safetensors")):
            warnings.warn(
                f"hf_zero: ignoring incomplete checkpoint {d} (no {MARKER})", stacklevel=2
            )
    return max(found, key=lambda d: (d / MARKER).stat().st_mtime) if found else None
