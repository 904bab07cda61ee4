"""Corrupted checkpoints are refused by name, on every rank together, before the first step.

Each case damages a copy of a real 2-rank stage-2 checkpoint the way the fault reports did:
flipped bytes in a rank's master shard, NaN in its optimizer state (written with valid
checksums, as a run that diverged would save it), a shard header whose offsets lie, a partition
map whose ``num_shards`` or ``shard_numel`` lies. Every rank must raise a ``ValueError`` (the
rank that read the damage names the file, tensor and parameter; the others say another rank
failed), instead of loading wrong weights, training on NaN or hanging.
"""

import json
import re
import shutil
import struct
from pathlib import Path

import torch
from helpers import MODEL
from safetensors import safe_open
from test_checkpoint import _rows, _try_load

import hf_zero
from hf_zero.storage.safetensors import write_streamed
from hf_zero.testing import run_distributed
from hf_zero.tiny import tiny_llama

RANK1 = "zero_rank00001.safetensors"


def _save(ckpt: str) -> None:
    model = tiny_llama(0, **MODEL)
    engine = hf_zero.initialize(model, torch.optim.AdamW(model.parameters()), stage=2)
    for step in range(2):
        x = _rows(step)
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
    engine.save_checkpoint(ckpt)


def _header(path: Path) -> tuple[dict, int]:
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + size]), 8 + size


def _flip_master_bytes(d: Path) -> None:
    header, start = _header(d / RANK1)
    begin = header["0.master"]["data_offsets"][0]
    with open(d / RANK1, "r+b") as f:
        f.seek(start + begin + 64)
        data = bytearray(f.read(16))
        f.seek(start + begin + 64)
        f.write(bytes(b ^ 0xFF for b in data))


def _poisoned(key: str, value: float):
    """Rewrite rank 1's file (checksums recomputed) with one non-finite value in ``key``."""

    def poison(d: Path) -> None:
        with safe_open(d / RANK1, framework="pt") as f:
            tensors = {k: f.get_tensor(k).clone() for k in f.keys()}  # noqa: SIM118
        tensors[key][3] = value
        spec = {k: (t.dtype, tuple(t.shape)) for k, t in tensors.items()}
        write_streamed([(spec, lambda: tensors)], d / RANK1)

    return poison


def _checksums_removed(d: Path) -> None:
    header, start = _header(d / RANK1)
    data = (d / RANK1).read_bytes()[start:]
    header.pop("__metadata__")
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    (d / RANK1).write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _lying_offsets(d: Path) -> None:
    header, start = _header(d / RANK1)
    data = (d / RANK1).read_bytes()[start:]
    begin, end = header["0.master"]["data_offsets"]
    header["0.master"]["data_offsets"] = [begin + 8, end + 8]
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    (d / RANK1).write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _edit_meta(change):
    def edit(d: Path) -> None:
        meta = json.loads((d / "zero_meta.json").read_text())
        change(meta["groups"][0])
        (d / "zero_meta.json").write_text(json.dumps(meta))

    return edit


CASES = {
    "flipped bytes": (_flip_master_bytes, r"zero_rank00001.safetensors: checksum mismatch in '0.master'"),
    "NaN in state": (_poisoned("0.state.exp_avg", float("nan")), r"holds NaN/Inf in 'state.exp_avg' of parameter '.*' \(zero_rank00001.safetensors; read on rank 1\)"),
    "Inf in master": (_poisoned("0.master", float("inf")), r"holds NaN/Inf in 'master' of parameter '.*' \(zero_rank00001.safetensors; read on rank 1\)"),
    "checksums removed": (_checksums_removed, r"zero_rank00001.safetensors has no checksum for '.*' \(and \d+ more\)"),
    "lying offsets": (_lying_offsets, r"zero_rank00001.safetensors: '0.master' header does not add up|'0.master' and '.*' overlap|is truncated"),
    "num_shards": (_edit_meta(lambda g: g.update(num_shards=1)), r"partition map of group 0 does not add up"),
    "shard_numel": (_edit_meta(lambda g: g.update(shard_numel=g["shard_numel"] * 2)), r"partition map of group 0 does not add up"),
}  # fmt: skip


def test_corrupted_checkpoints_are_refused_on_every_rank(tmp_path):
    good = tmp_path / "good"
    run_distributed(_save, 2, args=(str(good),))
    for name, (damage, match) in CASES.items():
        target = tmp_path / name.replace(" ", "_")
        shutil.copytree(good, target)
        damage(target)
        messages = run_distributed(_try_load, 2, args=(str(target), {}), timeout=120)
        named = [m for m in messages if re.search(match, m)]
        others = [m for m in messages if "failed to load on another rank" in m]
        assert named and len(named) + len(others) == 2, (name, messages)


def test_an_index_cannot_point_outside_its_folder(tmp_path):
    from safetensors.torch import save_file

    from hf_zero.checkpoint.consolidate import _frozen_from_saved

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    save_file({"secret": torch.ones(2)}, elsewhere / "other.safetensors")
    folder = tmp_path / "model"
    folder.mkdir()
    model = torch.nn.Linear(2, 1)
    for target in (str(elsewhere / "other.safetensors"), "../elsewhere/other.safetensors"):
        index = {"weight_map": {"weight": target, "bias": target}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        for load in (
            lambda: hf_zero.load_partitioned(model, folder),
            lambda: _frozen_from_saved(folder, []),
        ):
            try:
                load()
            except ValueError as error:
                assert "outside" in str(error) and "only name files in its own folder" in str(error)
            else:
                raise AssertionError(f"{target} was followed")
