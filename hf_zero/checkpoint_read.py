"""Reading engine checkpoints: the format's names, the metadata, and any element range of a
saved shard, read with positioned reads and checked against the file before it is trusted."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

FORMAT_VERSION = 2
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
    if meta.get("format_version", 0) < FORMAT_VERSION:
        raise ValueError(
            f"hf_zero: checkpoint '{directory}' has format_version {meta.get('format_version')}; "
            f"this hf_zero reads format {FORMAT_VERSION}"
        )
    tp_size = meta.get("tp_size", 1)
    for tp_rank in range(tp_size):
        for rank in range(meta["world_size"]):
            path = directory / shard_file(rank, tp_rank, tp_size)
            if not path.is_file():
                raise ValueError(f"hf_zero: checkpoint '{directory}' is missing {path.name}")
            SafetensorsSliceReader(path)  # header and size check: a truncated file fails by name
    return meta


CODE_DTYPES = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "U8": torch.uint8,
    "I64": torch.int64,
}


class SafetensorsSliceReader:
    """Reads a safetensors file with positioned reads: no memory map, so pages of the file never
    pile up in the process, and a truncated file is reported by name when it is opened."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError(f"hf_zero: {path} is truncated (no safetensors header)")
            (size,) = struct.unpack("<Q", raw)
            header = f.read(size)
            if len(header) != size:
                raise ValueError(f"hf_zero: {path} is truncated (incomplete header)")
        self.header = {k: v for k, v in json.loads(header).items() if k != "__metadata__"}
        self.data_start = 8 + size
        file_size = path.stat().st_size
        end = max((v["data_offsets"][1] for v in self.header.values()), default=0)
        if self.data_start + end > file_size:
            raise ValueError(
                f"hf_zero: {path} is truncated: {file_size} bytes, header promises "
                f"{self.data_start + end}"
            )

    def keys(self) -> list[str]:
        return list(self.header)

    def shape(self, key: str) -> list[int]:
        return self.header[key]["shape"]

    def read(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of tensor ``key``, flattened."""
        entry = self.header[key]
        dtype = CODE_DTYPES[entry["dtype"]]
        out = torch.empty(stop - start, dtype=dtype)
        itemsize = out.element_size()
        with open(self.path, "rb") as f:
            f.seek(self.data_start + entry["data_offsets"][0] + start * itemsize)
            f.readinto(memoryview(out.view(torch.uint8).numpy()))
        return out

    def tensor(self, key: str) -> torch.Tensor:
        """The whole tensor ``key``, in its shape (a fresh copy, never a view of the file)."""
        shape = self.shape(key)
        numel = 1
        for dim in shape:
            numel *= dim
        return self.read(key, 0, numel).view(shape)


class ShardReader:
    """Reads any element range of a parameter's saved values, from whichever old shards hold
    it; each rank's file is opened on first use. Shared by resharding load and consolidation."""

    def __init__(self, directory: Path, meta: dict, tp_rank: int = 0) -> None:
        self.directory = directory
        self.meta = meta
        self.tp_rank = tp_rank
        self._files: dict[int, SafetensorsSliceReader] = {}
        self.where = {}  # parameter name -> (old group, old slot)
        for group in meta["groups"]:
            for slot in group["params"]:
                self.where[slot["name"]] = (group, slot)

    def file(self, rank: int) -> SafetensorsSliceReader:
        if rank not in self._files:
            name = shard_file(rank, self.tp_rank, self.meta.get("tp_size", 1))
            self._files[rank] = SafetensorsSliceReader(self.directory / name)
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
            return self.file(0).read(tensor_key, lo, hi)  # stage 0: every rank saved it all
        pieces = []
        for rank in range(lo // shard, (hi - 1) // shard + 1):
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
