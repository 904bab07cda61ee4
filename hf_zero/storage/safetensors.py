"""safetensors files written one piece at a time, and read with positioned, checked reads.

Writing (`write_streamed`): a checkpoint's per-rank file holds every group's fp32 master shard
and optimizer state; with ZeRO-Infinity those live in swap files, and collecting them into one
dict for ``save_file`` would bring the whole state into memory at once. The header is written from
the pieces' dtypes and shapes (known without reading anything), then each piece is asked for its
tensors in turn: at most one group's tensors are in memory. Each tensor's CRC-32 per block goes
into ``__metadata__``; the file is a plain safetensors file (``safe_open`` / ``load_file`` read it).

Reading (`SafetensorsSliceReader`): any element range, with nothing in the file trusted.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import struct
import zlib
from collections.abc import Callable
from pathlib import Path

import torch

SAFETENSORS_CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}

CODE_DTYPES = {code: dtype for dtype, code in SAFETENSORS_CODES.items()}
"""safetensors dtype code -> torch dtype (the one table, read both ways)."""

Spec = dict[str, tuple[torch.dtype, tuple[int, ...]]]
"""Tensor name -> (dtype, shape), in the order the piece yields them."""
Piece = tuple[Spec, Callable[[], dict[str, torch.Tensor]]]


CRC_KEY = "hf_zero_crc32"
"""``__metadata__`` entry: per tensor, the CRC-32 of each `CRC_BLOCK` bytes of its data (256
KiB: a header of 32 bytes per MiB; a small read verifies at most two blocks)."""
CRC_BLOCK = 1 << 18
CHECKSUMS = True
"""Write checksums (switched off only by ``benchmarks/bench_checkpoint.py`` to measure them)."""


def pieces_nbytes(pieces: list[Piece]) -> int:
    """The bytes of tensor data ``pieces`` hold (what writing them needs on disk, headers
    aside), from their specs alone."""
    return sum(
        math.prod(shape) * dtype.itemsize for spec, _ in pieces for dtype, shape in spec.values()
    )


def write_streamed(
    pieces: list[Piece], path: str | os.PathLike, metadata: dict[str, str] | None = None
) -> None:
    """Write ``pieces`` (each: its spec, and a function returning its tensors) to ``path``,
    with ``metadata`` in the header's ``__metadata__`` (``{"format": "pt"}`` for files that
    ``from_pretrained`` reads).

    The header is written first with placeholder checksums of fixed width, then rewritten in
    place once the data is written and the checksums known (same length, same offsets).
    """
    header, offset = {}, 0
    for spec, _ in pieces:
        for name, (dtype, shape) in spec.items():
            nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
            header[name] = {
                "dtype": SAFETENSORS_CODES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
    crcs = {
        n: [0] * -(-(e["data_offsets"][1] - e["data_offsets"][0]) // CRC_BLOCK)
        for n, e in header.items()
    }
    raw = _header_bytes(header, crcs if CHECKSUMS else None, metadata)
    with open(Path(path), "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for spec, produce in pieces:
            tensors = produce()
            for name, (dtype, shape) in spec.items():
                t = tensors[name]
                if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                    raise ValueError(f"hf_zero: checkpoint tensor {name} changed while saving")
                data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
                if data.size:
                    f.write(data)
                if CHECKSUMS:
                    crcs[name] = block_crcs(data)
            del tensors
        if CHECKSUMS:
            final = _header_bytes(header, crcs, metadata)
            if len(final) != len(raw):
                raise RuntimeError("hf_zero: the checksum header changed length while saving")
            f.seek(8)
            f.write(final)
        f.flush()
        os.fsync(f.fileno())


def block_crcs(data) -> list[int]:
    """CRC-32 of each `CRC_BLOCK` bytes of ``data`` (a bytes-like object)."""
    view = memoryview(data).cast("B")
    return [zlib.crc32(view[i : i + CRC_BLOCK]) for i in range(0, len(view), CRC_BLOCK)]


def _header_bytes(
    header: dict, crcs: dict[str, list[int]] | None, metadata: dict[str, str] | None = None
) -> bytes:
    """The JSON header, checksums as fixed-width hex (8 digits each), padded to 8 bytes."""
    meta = dict(metadata or {})
    if crcs is not None:
        table = {name: "".join(f"{c:08x}" for c in values) for name, values in crcs.items()}
        meta[CRC_KEY] = json.dumps(table, separators=(",", ":"))
    if meta:
        header = {"__metadata__": meta, **header}
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors does


# --- reading ------------------------------------------------------------------------------------


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

    def __init__(self, path: Path, checksummed: bool = False) -> None:
        """``checksummed``: the file must carry a checksum for every tensor (hf_zero's own
        checkpoint shards do), so a file whose checksum table was removed is refused."""
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
        unchecked = [k for k in self.header if k not in self.crcs] if checksummed else []
        if unchecked:
            raise ValueError(
                f"hf_zero: {path} has no checksum for '{unchecked[0]}' (and "
                f"{len(unchecked) - 1} more): hf_zero writes one for every tensor of a "
                "checkpoint shard, so the file was altered or not written by this hf_zero"
            )
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
