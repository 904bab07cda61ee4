"""``hf-zero consolidate``: a sharded engine checkpoint -> Hugging Face safetensors, streamed.

Each parameter is assembled from the per-rank shard files by `checkpoint.ShardReader` (plain
positioned reads, no memory map, so pages of the inputs never pile up in this process) and
appended to the output
file, whose header is computed up front. Peak memory is one parameter plus small buffers,
whatever the model size. Outputs above ``max_shard_bytes`` are split into several files with a
``model.safetensors.index.json``, as ``save_pretrained`` does.

The checkpoint holds the *trainable* parameters (fp32 master weights). For a full fine-tune that
is the whole model; for a LoRA run ``--adapter-only`` writes ``adapter_model.safetensors`` with
PEFT's key names (frozen base weights come from the base model).
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import torch

from hf_zero.checkpoint import CODE_DTYPES, ShardReader, read_meta

_DTYPE_CODES = {dtype: code for code, dtype in CODE_DTYPES.items()}


class StreamingSafetensorsWriter:
    """Writes a safetensors file one tensor at a time, in the order of ``entries``."""

    def __init__(self, path: Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
        header, offset = {}, 0
        for name, dtype, shape in entries:
            nbytes = torch.empty(0, dtype=dtype).element_size()
            for dim in shape:
                nbytes *= dim
            header[name] = {
                "dtype": _DTYPE_CODES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        header["__metadata__"] = {"format": "pt"}
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # data starts 8-byte aligned
        self.file = open(path, "wb")  # noqa: SIM115  (closed in close())
        self.file.write(struct.pack("<Q", len(encoded)) + encoded)
        self.expected = [name for name, _, _ in entries]

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if name != self.expected.pop(0):
            raise RuntimeError(f"tensor {name} written out of order")
        self.file.write(tensor.contiguous().view(torch.uint8).numpy().tobytes())

    def close(self) -> None:
        self.file.close()


def consolidate(
    checkpoint: str | Path,
    output: str | Path,
    dtype: torch.dtype = torch.float32,
    adapter_only: bool = False,
    max_shard_bytes: int = 5 * 2**30,
) -> list[Path]:
    """Write the checkpoint's parameters as Hugging Face safetensors; returns the files."""
    checkpoint, output = Path(checkpoint), Path(output)
    reader = ShardReader(checkpoint, read_meta(checkpoint))
    meta = reader.meta
    if meta.get("tp_size", 1) > 1:
        raise NotImplementedError(
            f"hf_zero consolidate: '{checkpoint}' holds tensor-parallel slices (tp_size = "
            f"{meta['tp_size']}); joining them offline is not implemented. Save full weights "
            "from the run instead (save_model / save_pretrained gathers across TP ranks)"
        )

    params = [slot for group in meta["groups"] for slot in group["params"]]
    if adapter_only:
        params = [s for s in params if ".lora_" in s["name"]]
        if not params:
            raise ValueError(f"hf_zero: --adapter-only: no LoRA parameters in {checkpoint}")
    entries = [(_output_name(s["name"], adapter_only), dtype, tuple(s["shape"])) for s in params]
    itemsize = torch.empty(0, dtype=dtype).element_size()
    files: list[list[int]] = [[]]
    size = 0
    for i, s in enumerate(params):
        nbytes = s["numel"] * itemsize
        if files[-1] and size + nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(i)
        size += nbytes
    output.mkdir(parents=True, exist_ok=True)
    stem = "adapter_model" if adapter_only else "model"
    names = (
        [f"{stem}.safetensors"]
        if len(files) == 1
        else [f"{stem}-{k + 1:05d}-of-{len(files):05d}.safetensors" for k in range(len(files))]
    )
    written = []
    weight_map = {}
    for file_name, indices in zip(names, files):
        writer = StreamingSafetensorsWriter(output / file_name, [entries[i] for i in indices])
        for i in indices:
            slot = params[i]
            values = reader.read(slot["name"], "master", 0, slot["numel"])
            values = values.to(dtype).view(tuple(slot["shape"]))
            writer.write(entries[i][0], values)
            weight_map[entries[i][0]] = file_name
            del values
        writer.close()
        written.append(output / file_name)
    if len(files) > 1:
        index = {
            "metadata": {"total_size": sum(p.stat().st_size for p in written)},
            "weight_map": weight_map,
        }
        (output / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return written


def _output_name(name: str, adapter_only: bool) -> str:
    # PEFT saves adapter weights without the adapter's name: "...lora_A.default.weight" ->
    # "...lora_A.weight".
    return (
        re.sub(r"\.(lora_[AB]|lora_embedding_[AB])\.[^.]+\.", r".\1.", name)
        if adapter_only
        else name
    )
