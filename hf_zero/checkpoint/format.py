"""Reading engine checkpoints: the format's names, the metadata, and any element range of a
saved shard, read with positioned reads and checked against the file before it is trusted."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from hf_zero.storage.safetensors import SafetensorsSliceReader

FORMAT_VERSION = 3
"""3: every tensor of a shard file carries block checksums, and a load requires them (2: read,
checksums verified where present)."""
REQUIRE_CHECKSUMS = True
"""Refuse a format-3 shard file without a checksum for every tensor (benchmarks switch it off
to time a load without checksums)."""
META = "zero_meta.json"
MARKER = "COMPLETE"


def shard_file(dp_rank: int, tp_rank: int = 0, tp_size: int = 1) -> str:
    """One data-parallel rank's file (with AutoTP, of one tensor-parallel rank)."""
    if tp_size == 1:
        return f"zero_rank{dp_rank:05d}.safetensors"
    return f"zero_tp{tp_rank:02d}_rank{dp_rank:05d}.safetensors"


def is_complete(directory: str | Path) -> bool:
    return (Path(directory) / MARKER).is_file()


# ----------------------------------------------------------------------------------------------
# saving
# ----------------------------------------------------------------------------------------------


def read_meta(directory: str | Path) -> dict:
    """Validate a checkpoint directory and return its metadata."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"hf_zero: checkpoint '{directory}' does not exist")
    if not is_complete(directory):
        raise ValueError(
            f"hf_zero: '{directory}' is not a complete checkpoint (no {MARKER} marker: the save "
            "did not finish)"
        )
    meta = json.loads((directory / META).read_text())
    if meta.get("format_version", 0) > FORMAT_VERSION:
        raise ValueError(
            f"hf_zero: checkpoint '{directory}' has format_version {meta['format_version']}; this "
            f"hf_zero ({FORMAT_VERSION}) is older than the one that wrote it: upgrade hf_zero"
        )
    if meta.get("format_version", 0) < 2:
        raise ValueError(
            f"hf_zero: checkpoint '{directory}' has format_version {meta.get('format_version')}; "
            f"this hf_zero reads formats 2 and {FORMAT_VERSION}"
        )
    tp_size = meta.get("tp_size", 1)
    for tp_rank in range(tp_size):
        for rank in range(meta["world_size"]):
            path = directory / shard_file(rank, tp_rank, tp_size)
            if not path.is_file():
                raise ValueError(f"hf_zero: checkpoint '{directory}' is missing {path.name}")
            # Header and size checks: a truncated or edited file fails by name, on every rank.
            _check_groups(meta, SafetensorsSliceReader(path), directory)
    return meta


def _check_groups(meta: dict, file: SafetensorsSliceReader, directory: Path) -> None:
    """The partition map adds up and agrees with what ``file`` holds."""
    world = meta["world_size"]
    for group in meta["groups"]:
        index, shards = group["index"], group["num_shards"]
        shard, padded = group["shard_numel"], group["padded_numel"]
        problem = None
        if shards not in (1, world) or shard * shards != padded:
            problem = f"{shards} shards of {shard} for {padded} elements over {world} ranks"
        for slot in group["params"]:
            size = math.prod(slot["shape"])
            if slot["numel"] != size or not 0 <= slot["offset"] <= padded - size:
                problem = f"'{slot['name']}' at {slot['offset']}+{slot['numel']} of {padded}"
        key = f"{index}.master"
        if key in file.header and math.prod(file.shape(key)) != shard:
            problem = f"{file.path.name} holds {math.prod(file.shape(key))} master elements"
        if problem is not None:
            raise ValueError(
                f"hf_zero: checkpoint '{directory}': the partition map of group {index} does "
                f"not add up ({problem}); the metadata or a shard file was changed"
            )


class ShardReader:
    """Reads any element range of a parameter's saved values, from whichever old shards hold
    it; each rank's file is opened on first use. Shared by resharding load and consolidation."""

    def __init__(self, directory: Path, meta: dict, tp_rank: int = 0) -> None:
        self.directory = directory
        self.meta = meta
        self.tp_rank = tp_rank
        self._files: dict[int, SafetensorsSliceReader] = {}
        self.last_files: list[str] = []  # the files the last `read` took its values from
        self.where = {}  # parameter name -> (old group, old slot)
        for group in meta["groups"]:
            for slot in group["params"]:
                self.where[slot["name"]] = (group, slot)

    def file(self, rank: int) -> SafetensorsSliceReader:
        if rank not in self._files:
            name = shard_file(rank, self.tp_rank, self.meta.get("tp_size", 1))
            checksummed = REQUIRE_CHECKSUMS and self.meta["format_version"] >= 3
            self._files[rank] = SafetensorsSliceReader(self.directory / name, checksummed)
        return self._files[rank]

    def read(self, name: str, key: str, start: int, count: int) -> torch.Tensor | None:
        """Elements ``[start, start + count)`` of parameter ``name``'s ``key`` ("master" or
        "state.exp_avg", ...), flattened; ``None`` if the checkpoint has no such tensor."""
        group, slot = self.where[name]
        tensor_key = f"{group['index']}.{key}"
        if tensor_key not in self.file(0).header:
            return None
        lo = slot["offset"] + start
        hi = lo + count
        shard = group["shard_numel"]
        if group["num_shards"] == 1:
            self.last_files = [self.file(0).path.name]
            return self.file(0).read(tensor_key, lo, hi)  # stage 0: every rank saved it all
        pieces = []
        ranks = range(lo // shard, (hi - 1) // shard + 1)
        self.last_files = [self.file(rank).path.name for rank in ranks]
        for rank in ranks:
            base = rank * shard
            pieces.append(
                self.file(rank).read(tensor_key, max(lo, base) - base, min(hi, base + shard) - base)
            )
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0]

    def scalar(self, name: str, key: str) -> torch.Tensor | None:
        group, _ = self.where[name]
        tensor_key = f"{group['index']}.{key}"
        if tensor_key not in self.file(0).header:
            return None
        # A fresh tensor per call: optimizers update step counters in place, so two buckets
        # must never share one.
        return self.file(0).tensor(tensor_key)
