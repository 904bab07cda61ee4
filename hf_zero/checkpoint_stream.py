"""Writing a safetensors file one piece at a time, so a rank never holds its whole state.

A checkpoint's per-rank file holds every group's fp32 master shard and optimizer state. With
ZeRO-Infinity those live in swap files; collecting them into one dict for ``save_file`` would
bring the whole state into memory at once. `write_streamed` instead writes the safetensors header
from the pieces' dtypes and shapes (known without reading anything), then asks each piece for its
tensors in turn and writes them: at most one group's tensors are in memory. The file is a plain
safetensors file (``safe_open`` / ``load_file`` read it; tested).
"""

from __future__ import annotations

import json
import math
import os
import struct
import zlib
from collections.abc import Callable
from pathlib import Path

import torch

DTYPES = {
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

Spec = dict[str, tuple[torch.dtype, tuple[int, ...]]]
"""Tensor name -> (dtype, shape), in the order the piece yields them."""
Piece = tuple[Spec, Callable[[], dict[str, torch.Tensor]]]


CRC_KEY = "hf_zero_crc32"
"""``__metadata__`` entry: per tensor, the CRC-32 of each `CRC_BLOCK` bytes of its data (256
KiB: a header of 32 bytes per MiB; a small read verifies at most two blocks)."""
CRC_BLOCK = 1 << 18
CHECKSUMS = True
"""Write checksums (switched off only by ``benchmarks/bench_checkpoint.py`` to measure them)."""


def write_streamed(pieces: list[Piece], path: str | os.PathLike) -> None:
    """Write ``pieces`` (each: its spec, and a function returning its tensors) to ``path``.

    The header is written first with placeholder checksums of fixed width, then rewritten in
    place once the data is written and the checksums known (same length, same offsets).
    """
    header, offset = {}, 0
    for spec, _ in pieces:
        for name, (dtype, shape) in spec.items():
            nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
            header[name] = {
                "dtype": DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
    crcs = {
        n: [0] * -(-(e["data_offsets"][1] - e["data_offsets"][0]) // CRC_BLOCK)
        for n, e in header.items()
    }
    raw = _header_bytes(header, crcs if CHECKSUMS else None)
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
            final = _header_bytes(header, crcs)
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


def _header_bytes(header: dict, crcs: dict[str, list[int]] | None) -> bytes:
    """The JSON header, checksums as fixed-width hex (8 digits each), padded to 8 bytes."""
    if crcs is not None:
        table = {name: "".join(f"{c:08x}" for c in values) for name, values in crcs.items()}
        header = {"__metadata__": {CRC_KEY: json.dumps(table, separators=(",", ":"))}, **header}
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors does
