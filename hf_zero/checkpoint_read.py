"""Reading engine checkpoints: the format's names, the metadata, and any element range of a
saved shard, read with positioned reads and checked against the file before it is trusted."""

from __future__ import annotations

import itertools
import json
import math
import struct
from pathlib import Path

import torch

from hf_zero.checkpoint_stream import CRC_BLOCK, CRC_KEY, block_crcs

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


CODE_DTYPES = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "U8": torch.uint8,
    "I64": torch.int64,
}


CACHED_TENSORS = 4
"""Tensors whose last small read a reader keeps (a group's master and optimizer state are read
in turn, parameter by parameter): at most 4 x 1 MiB."""


class SafetensorsSliceReader:
    """Reads a safetensors file with positioned reads: no memory map, so pages of the file never
    pile up in the process. Nothing in the file is trusted: when it is opened, every tensor's
    dtype, shape and byte range are checked against each other and the file size (a truncated
    or edited file is reported by name); every read is bounds-checked, must return all its
    bytes, and, for files hf_zero wrote, is verified against the CRC-32 of each 256 KiB block it
    touches."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError(f"hf_zero: {path} is truncated (no safetensors header)")
            (size,) = struct.unpack("<Q", raw)
            file_size = path.stat().st_size
            if size > file_size - 8:
                raise ValueError(f"hf_zero: {path} is truncated (incomplete header)")
            header = f.read(size)
        try:
            parsed = json.loads(header)
        except ValueError:
            raise ValueError(f"hf_zero: {path} has a corrupted header") from None
        metadata = parsed.pop("__metadata__", None) or {}
        self.header = parsed
        self.data_start = 8 + size
        self.crcs = _parse_crcs(metadata.get(CRC_KEY), path)
        self._last: dict[str, tuple[int, torch.Tensor]] = {}  # a few tensors' last small read
        _check_entries(self.header, self.crcs, file_size - self.data_start, path)

    def keys(self) -> list[str]:
        return list(self.header)

    def shape(self, key: str) -> list[int]:
        return self.header[key]["shape"]

    def read(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of tensor ``key``, flattened."""
        entry = self.header[key]
        dtype = CODE_DTYPES[entry["dtype"]]
        numel = math.prod(entry["shape"])
        if not 0 <= start <= stop <= numel:
            raise ValueError(
                f"hf_zero: {self.path}: elements [{start}, {stop}) of '{key}' asked for, but it "
                f"holds {numel} (the checkpoint's metadata does not match its files)"
            )
        itemsize = torch.empty(0, dtype=dtype).element_size()
        lo, hi = start * itemsize, stop * itemsize
        blocks = self.crcs.get(key)
        if blocks is not None:  # read whole blocks, verify them, keep the part asked for
            lo, hi = lo - lo % CRC_BLOCK, min(-(-hi // CRC_BLOCK) * CRC_BLOCK, numel * itemsize)
        cached_lo, cached = self._last.pop(key, (0, torch.empty(0)))
        if cached_lo <= lo and hi <= cached_lo + cached.numel():
            data, shared = cached[lo - cached_lo : hi - cached_lo], True  # a neighbour's block
            self._last[key] = (cached_lo, cached)
        else:
            shared = False
            data = self._read_verified(key, entry, lo, hi, blocks)
            # Only the last block is kept: sequential small reads share it, and holding more
            # would grow with the tensors a caller walks through.
            tail = max(lo, hi - CRC_BLOCK)
            self._last[key] = (tail, data[tail - lo :].clone())
        while len(self._last) > CACHED_TENSORS:
            del self._last[next(iter(self._last))]
        part = data[start * itemsize - lo : stop * itemsize - lo]
        # A fresh tensor that holds no more than it shows: optimizers update step counters in
        # place, and a small view would pin its whole block.
        if shared or part.numel() <= data.numel() // 2:
            part = part.clone()
        return part.view(dtype)

    def _read_verified(self, key: str, entry: dict, lo: int, hi: int, blocks) -> torch.Tensor:
        """Bytes ``[lo, hi)`` of ``key``'s data, all of them, checked against ``blocks``."""
        data = torch.empty(hi - lo, dtype=torch.uint8)
        with open(self.path, "rb") as f:
            f.seek(self.data_start + entry["data_offsets"][0] + lo)
            got = f.readinto(memoryview(data.numpy())) if data.numel() else 0
        if got != data.numel():
            raise ValueError(f"hf_zero: {self.path}: short read of '{key}' (file changed?)")
        if blocks is not None:
            first = lo // CRC_BLOCK
            for i, crc in enumerate(block_crcs(data.numpy())):
                if crc != blocks[first + i]:
                    raise ValueError(
                        f"hf_zero: {self.path}: checksum mismatch in '{key}' (bytes "
                        f"{lo + i * CRC_BLOCK}..): the file is corrupted; resume from an "
                        "earlier checkpoint"
                    )
        return data

    def tensor(self, key: str) -> torch.Tensor:
        """The whole tensor ``key``, in its shape (a fresh copy, never a view of the file)."""
        shape = self.shape(key)
        return self.read(key, 0, math.prod(shape)).view(shape)


def _parse_crcs(table: str | None, path: Path) -> dict[str, list[int]]:
    if table is None:
        return {}
    try:
        return {
            name: [int(hexes[i : i + 8], 16) for i in range(0, len(hexes), 8)]
            for name, hexes in json.loads(table).items()
        }
    except (ValueError, TypeError, AttributeError):
        raise ValueError(f"hf_zero: {path} has a corrupted checksum table") from None


def _check_entries(header: dict, crcs: dict, data_size: int, path: Path) -> None:
    """Each tensor's byte range agrees with its dtype and shape, lies inside the file, and no
    two overlap; its checksum table has one entry per block."""
    spans = []
    for key, entry in header.items():
        try:
            dtype = CODE_DTYPES[entry["dtype"]]
            shape = [int(d) for d in entry["shape"]]
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"hf_zero: {path}: '{key}' has a corrupted header entry") from None
        nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        if min(shape, default=0) < 0 or not 0 <= begin <= end or end - begin != nbytes:
            raise ValueError(
                f"hf_zero: {path}: '{key}' header does not add up (shape {shape}, bytes "
                f"{begin}..{end})"
            )
        if end > data_size:
            raise ValueError(
                f"hf_zero: {path} is truncated: '{key}' ends at byte {end} of the data, the "
                f"file holds {data_size}"
            )
        if key in crcs and len(crcs[key]) != -(-nbytes // CRC_BLOCK):
            raise ValueError(f"hf_zero: {path}: '{key}' has a corrupted checksum table")
        spans.append((begin, end, key))
    spans.sort()
    for (_, end, key), (begin, _, other) in itertools.pairwise(spans):
        if begin < end:
            raise ValueError(f"hf_zero: {path}: '{key}' and '{other}' overlap in the file")


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


def indexed_files(folder: Path, index: Path) -> dict[str, Path]:
    """A Hugging Face ``*.safetensors.index.json``'s tensor -> file map, each file checked to
    lie inside ``folder`` (an index is data: it must not point at other files on the host)."""
    root = folder.resolve()
    out = {}
    for name, file_name in json.loads(index.read_text())["weight_map"].items():
        path = (folder / file_name).resolve()
        if not isinstance(file_name, str) or not path.is_relative_to(root):
            raise ValueError(
                f"hf_zero: {index} maps '{name}' to {file_name!r}, outside {folder}: an index "
                "may only name files in its own folder"
            )
        out[name] = path
    return out
