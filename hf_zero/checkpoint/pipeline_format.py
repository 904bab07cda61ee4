"""The pipeline checkpoint format: names, the metadata check, stage files read by tensor name,
and offline consolidation into one Hugging Face ``model.safetensors``.

Layout of a checkpoint directory::

    pipeline_meta.json                 layout (pp/dp/tp sizes, ZeRO stage, schedule), step
                                       counter, optimizer hyperparameters, scheduler state,
                                       every file's parameter names, TP splits
    stage_pp00_tp00.safetensors        the parameters (fp32) of pipeline rank 0's stages and
    stage_pp01_tp00.safetensors        their optimizer state, ``param/<name>`` and
    ...                                ``state/<name>/<key>`` (ZeRO-1/2 shards gathered first),
                                       with a CRC-32 per 256 KiB block of each tensor
    COMPLETE                           written last

Every tensor is stored per parameter under its model name, not per flat buffer or stage index,
so a checkpoint loads at another ``pp_size``, ``pp_partition``, data-parallel size or ZeRO stage:
each rank reads the names its new stages hold. Only ``tp_size`` must match (the files hold TP
slices). What a `PipelineEngine` writes and reads is `hf_zero.engine.pipeline_checkpointing`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from hf_zero.checkpoint.format import MARKER
from hf_zero.sharding.tp import TPShard, unsplit
from hf_zero.storage.safetensors import SafetensorsSliceReader

META = "pipeline_meta.json"
FORMAT = "hf_zero-pipeline"
VERSION = 2
"""2: every stage file carries a CRC-32 per block of each tensor (`write_streamed`)."""


def stage_file(pp_rank: int, tp_rank: int) -> str:
    return f"stage_pp{pp_rank:02d}_tp{tp_rank:02d}.safetensors"


def is_pipeline_checkpoint(directory: str | Path) -> bool:
    return (Path(directory) / META).is_file()


def read_meta(directory: str | Path) -> dict:
    """Validate a pipeline checkpoint directory and return its metadata."""
    directory = Path(directory)
    if not (directory / MARKER).is_file() or not (directory / META).is_file():
        raise ValueError(
            f"hf_zero pipeline: '{directory}' is not a complete pipeline checkpoint (no {META} "
            f"or no {MARKER} marker: the save did not finish)"
        )
    meta = json.loads((directory / META).read_text())
    if meta.get("format") != FORMAT or meta.get("format_version", 0) > VERSION:
        raise ValueError(
            f"hf_zero pipeline: '{directory}' has format {meta.get('format')!r} version "
            f"{meta.get('format_version')}; this hf_zero reads {FORMAT!r} up to {VERSION}"
        )
    for name in meta["files"]:
        if not (directory / name).is_file():
            raise ValueError(f"hf_zero pipeline: checkpoint '{directory}' is missing {name}")
    return meta


class StageFiles:
    """Tensors by name across a checkpoint's stage files of one TP rank, read when asked for:
    every read is checked against the file's CRC-32s (format version 2 on; version 1 files carry
    none), and a value that is NaN or Inf is refused."""

    def __init__(self, directory: Path, meta: dict, tp_rank: int) -> None:
        suffix = f"_tp{tp_rank:02d}.safetensors"
        self.checksummed = meta.get("format_version", 1) >= 2
        self.where = {
            name: directory / file
            for file, names in meta["files"].items()
            if file.endswith(suffix)
            for name in names
        }
        self._readers: dict[Path, SafetensorsSliceReader] = {}

    def _reader(self, path: Path) -> SafetensorsSliceReader:
        if path not in self._readers:
            self._readers[path] = SafetensorsSliceReader(path, checksummed=self.checksummed)
        return self._readers[path]

    def get(self, key: str) -> torch.Tensor | None:
        name = key.split("/")[1]
        path = self.where.get(name)
        if path is None:
            return None
        reader = self._reader(path)
        return self._finite(reader.tensor(key), key, path) if key in reader.header else None

    def state(self, name: str) -> dict[str, torch.Tensor]:
        path = self.where[name]
        reader, prefix = self._reader(path), f"state/{name}/"
        return {
            k[len(prefix) :]: self._finite(reader.tensor(k), k, path)
            for k in reader.header
            if k.startswith(prefix)
        }

    @staticmethod
    def _finite(value: torch.Tensor, key: str, path: Path) -> torch.Tensor:
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise ValueError(
                f"hf_zero pipeline: '{key}' in {path} holds NaN/Inf; resume from an earlier "
                "checkpoint"
            )
        return value


def consolidate_pipeline(
    directory: str | Path, output: str | Path, dtype: torch.dtype = torch.float32
) -> list[Path]:
    """``hf-zero consolidate`` for a pipeline checkpoint: every stage's parameters (TP slices
    joined) in one ``model.safetensors`` with the model's own names. One process, no group."""
    directory, output = Path(directory), Path(output)
    meta = read_meta(directory)
    per_tp = [StageFiles(directory, meta, t) for t in range(meta["tp_size"])]
    full = {}
    for name in sorted(per_tp[0].where):
        pieces = [files.get(f"param/{name}") for files in per_tp]
        split = meta["tp_shards"].get(name)
        value = unsplit(pieces, TPShard(*split)) if split else pieces[0]
        full[name] = value.to(dtype).contiguous()
    output.mkdir(parents=True, exist_ok=True)
    path = output / "model.safetensors"
    save_file(full, str(path), metadata={"format": "pt"})
    return [path]
