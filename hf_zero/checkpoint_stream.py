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


def write_streamed(pieces: list[Piece], path: str | os.PathLike) -> None:
    """Write ``pieces`` (each: its spec, and a function returning its tensors) to ``path``."""
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
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(Path(path), "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for spec, produce in pieces:
            tensors = produce()
            for name, (dtype, shape) in spec.items():
                t = tensors[name]
                if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                    raise ValueError(f"hf_zero: checkpoint tensor {name} changed while saving")
                data = t.detach().to("cpu").contiguous().reshape(-1)
                f.write(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
            del tensors
        f.flush()
        os.fsync(f.fileno())
