"""``save_pretrained`` from a sharded engine, streamed: one group gathered at a time, written
straight into Hugging Face sharded safetensors.

What it writes is what ``model.save_pretrained(dir, state_dict=engine.saved_state_dict())``
writes: ``config.json`` (its ``dtype`` that of the weights written), ``generation_config.json``
for generative models, and ``model.safetensors`` or ``model-0000k-of-0000n.safetensors`` plus
``model.safetensors.index.json`` (``max_shard_size`` as transformers reads it), tied weights
once under the name transformers keeps, and weight conversions reverted to the checkpoint
format (``revert_weight_conversion``). ``from_pretrained`` loads it.

How it stays small: every name, dtype and shape is known without gathering anything (a stage-3
parameter's whole shape is its ``ds_shape``), so the file split and every safetensors header are
planned first (`plan_files`); then `state_dict_pieces` gathers one group at a time and
`write_streamed` writes its tensors and drops them. A rank holds at most one group's weights
(gathered, plus their CPU copies) and one tensor being written. The other ranks take part in
each gather and write nothing. Each file is written under a temporary name and renamed when
complete, so a failed save leaves no half-written weights file under a real name.

Not streamed (``saved_state_dict`` + ``save_pretrained`` instead): tensor-parallel models (their
weights are gathered over the TP group as a whole) and bitsandbytes bases (their quantization
state is written with them); `streamable` says which. A PEFT model saves its adapter, which is
small: it is gathered alone (`route_model_save`), never the base.
"""

from __future__ import annotations

import functools
import json
import os
import re
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hf_zero.engine.full_state_dict import (
    exported_groups,
    keys_by_param,
    saved_export,
    saved_state_dict,
    state_dict_pieces,
)
from hf_zero.engine.save_failure import agree_on_failure
from hf_zero.storage.safetensors import write_streamed

if TYPE_CHECKING:
    from hf_zero.engine.state_view import EngineState

Spec = tuple[torch.dtype, tuple[int, ...]]
Convert = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def streamable(engine: EngineState) -> bool:
    """Whether `save_pretrained` can stream this engine's model (module docstring)."""
    model = engine.module
    return (
        engine.tp is None
        and hasattr(model, "config")
        and hasattr(model, "can_generate")
        and not hasattr(model, "peft_config")
        and all(g.packed is None for g in engine.groups + engine.frozen_groups)
    )


def route_model_save(engine: EngineState) -> None:
    """Make the model's own ``save_pretrained(dir)`` (no ``state_dict``, safetensors, no hub
    push) stream through `save_pretrained` under stage 3, instead of the state-dict hooks'
    whole CPU copy on every rank; any other call goes to transformers' own as before. A PEFT
    model's save gets its adapter gathered alone (`_adapter_save`)."""
    model = engine.module
    original = getattr(model, "save_pretrained", None)
    engine_ref = weakref.ref(engine)
    if original is not None and hasattr(model, "peft_config") and engine.tp is None:
        model.save_pretrained = _adapter_save(original, engine_ref)
        return
    if not streamable(engine):
        return

    @functools.wraps(original)
    def save(save_directory, is_main_process=True, state_dict=None, max_shard_size="50GB", **kw):
        live = engine_ref()
        plain = set(kw) <= {"safe_serialization", "save_function"}
        if live is None or state_dict is not None or not plain or kw.get("safe_serialization") is False:  # fmt: skip
            return original(
                save_directory, is_main_process=is_main_process, state_dict=state_dict,
                max_shard_size=max_shard_size, **kw,
            )  # fmt: skip
        live.save_pretrained(save_directory, is_main_process, max_shard_size=max_shard_size)
        return None

    model.save_pretrained = save


def _adapter_save(original: Callable, engine_ref: weakref.ref) -> Callable:
    """A PEFT model's ``save_pretrained``: given the adapter's parameters gathered (every rank
    gets them: they are small), so PEFT never asks for the whole model's state dict."""

    @functools.wraps(original)
    def save(save_directory, *args, **kw):
        live = engine_ref()
        if live is not None and kw.get("state_dict") is None:
            kw["state_dict"] = saved_state_dict(live, rank0_only=False, only_trainable=True)
        return original(save_directory, *args, **kw)

    return save


@dataclass
class FilePlan:
    """One safetensors file: its name and its tensors' specs in writing order."""

    name: str
    specs: dict[str, Spec] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(*spec) for spec in self.specs.values())


def save_pretrained(
    engine: EngineState,
    save_directory: str | os.PathLike,
    is_main_process: bool = True,
    max_shard_size: int | str = "50GB",
) -> list[Path]:
    """Write the model as ``from_pretrained`` reads it, one group at a time (collective: every
    rank calls it; ``is_main_process`` writes). Returns the weight files written."""
    model = engine.module
    if not streamable(engine):
        raise ValueError(
            "hf_zero: this model cannot be saved streamed (tensor-parallel, a bitsandbytes base "
            "or PEFT); use model.save_pretrained(dir, state_dict=engine.saved_state_dict())"
        )
    export = saved_export(engine, keep=is_main_process)
    pieces = state_dict_pieces(engine, export)
    directory = Path(save_directory)
    if not is_main_process:
        for _ in pieces:  # the gathers are collective; nothing to write here
            pass
        agree_on_failure(engine, None, 0, directory, None)
        return []
    specs = piece_specs(engine, export.original_dtypes, export.master_weights)
    kept, convert = saved_keys(model, specs), _conversion(model)
    files = plan_files(specs, kept, convert, _size_limit(max_shard_size))
    cursor = _PieceCursor(pieces, kept, convert)
    written, partial, failure = [], None, None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for plan in files:
            partial = directory / f".{plan.name}.partial"
            entries = [({name: spec}, functools.partial(cursor.take, name)) for name, spec in plan.specs.items()]  # fmt: skip
            write_streamed(entries, partial, metadata={"format": "pt"})
            os.replace(partial, directory / plan.name)
            written.append(directory / plan.name)
    except (OSError, RuntimeError) as error:
        failure = error  # keep taking part in the gathers: the other ranks are in them
    else:
        partial = None  # each file was renamed into place
    cursor.drain()
    agree_on_failure(engine, failure, sum(p.nbytes for p in files), directory, partial)
    _remove_stale_shards(directory, {p.name for p in files})
    index = directory / "model.safetensors.index.json"
    if len(files) > 1:
        weight_map = {name: p.name for p in files for name in p.specs}
        content = {
            "metadata": {
                "total_parameters": sum(_numel(s) for p in files for s in p.specs.values()),
                "total_size": sum(p.nbytes for p in files),
            },
            "weight_map": weight_map,
        }
        index.write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
    elif index.exists():
        index.unlink()  # a previous sharded save's index would point at removed files
    _save_configs(model, files, directory)
    return written


def piece_specs(
    engine: EngineState, original_dtypes: bool, master_weights: bool
) -> list[dict[str, Spec]]:
    """The specs of the pieces `state_dict_pieces` will yield, in order, read from the
    parameters' metadata (nothing gathered)."""
    model = engine.module
    state = model.state_dict(keep_vars=True)
    owners = keys_by_param(model)

    def dtype_of(p: torch.Tensor, trainable: bool) -> torch.dtype:
        names = owners.get(id(p)) if original_dtypes else None
        loaded = engine.loaded_dtypes.get(names[0]) if names else None
        if loaded is not None and p.is_floating_point():
            return loaded
        return torch.float32 if master_weights and trainable else p.dtype

    specs, done = [], set()
    for group in exported_groups(engine, saved_export(engine, True)):
        piece = {}
        for p in group.params:
            shape = tuple(getattr(p, "ds_shape", None) or p.shape)
            for key in owners.get(id(p), ()):
                if key in state:
                    piece[key] = (dtype_of(p, group.trainable), shape)
            done.add(id(p))
        specs.append(piece)
    rest = {}
    names = dict(model.named_parameters(remove_duplicate=False))
    for key, tensor in state.items():
        p = names.get(key)
        if p is not None and id(p) in done:
            continue
        dtype = dtype_of(p, False) if p is not None else tensor.dtype
        rest[key] = (dtype, tuple(tensor.shape))
    specs.append(rest)
    return specs


def plan_files(
    specs: list[dict[str, Spec]], kept: set[str], convert: Convert, limit: int
) -> list[FilePlan]:
    """Split the ``kept`` tensors, converted, into files of at most ``limit`` bytes (a tensor
    larger than that gets a file of its own); worked out on meta tensors."""
    files = [FilePlan("")]
    for piece in specs:
        meta = {k: torch.empty(s[1], dtype=s[0], device="meta") for k, s in piece.items() if k in kept}  # fmt: skip
        for name, tensor in convert(meta).items():
            spec = (tensor.dtype, tuple(tensor.shape))
            if files[-1].specs and files[-1].nbytes + _nbytes(*spec) > limit:
                files.append(FilePlan(""))
            files[-1].specs[name] = spec
    for k, plan in enumerate(files):
        plan.name = (
            "model.safetensors"
            if len(files) == 1
            else f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
        )
    return files


class _PieceCursor:
    """Hands out the tensors of `state_dict_pieces` by name, in the order the files were
    planned: moving to the next piece drops the previous one (and releases its group)."""

    def __init__(
        self, pieces: Iterator[dict[str, torch.Tensor]], kept: set[str], convert: Convert
    ) -> None:
        self.pieces = pieces
        self.kept = kept
        self.convert = convert
        self.current: dict[str, torch.Tensor] = {}

    def take(self, name: str) -> dict[str, torch.Tensor]:
        while name not in self.current:
            piece = next(self.pieces, None)
            if piece is None:
                raise RuntimeError(f"hf_zero: '{name}' was planned but never produced")
            self.current = self.convert({k: v for k, v in piece.items() if k in self.kept})
        return {name: self.current[name]}

    def drain(self) -> None:
        """Run the export to its end (its last gathers are collective)."""
        self.current = {}
        for _ in self.pieces:
            pass


def saved_keys(model: torch.nn.Module, specs: list[dict[str, Spec]]) -> set[str]:
    """Keys ``save_pretrained`` writes: without ``_keys_to_ignore_on_save`` and with one name
    per tied weight (transformers' own choice, made on meta stand-ins that share an object
    exactly where parameters do)."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    ignore = getattr(model, "_keys_to_ignore_on_save", None) or []
    stand_in: dict[int, torch.Tensor] = {}
    meta = {}
    for piece in specs:
        for key, (dtype, shape) in piece.items():
            if key in ignore:
                continue
            tensor = model.get_parameter_or_buffer(key)
            if id(tensor) not in stand_in:
                stand_in[id(tensor)] = torch.empty(shape, dtype=dtype, device="meta")
            meta[key] = stand_in[id(tensor)]
    return set(remove_tied_weights_from_state_dict(meta, model))


def _conversion(model: torch.nn.Module) -> Convert:
    """The model's weight conversions reverted (checkpoint names and layouts), as
    ``save_pretrained`` does by default; one piece holds a whole unit, so every conversion's
    inputs are in the same piece."""
    from transformers.core_model_loading import revert_weight_conversion

    def convert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return revert_weight_conversion(model, state) if state else state

    return convert


def _save_configs(model: torch.nn.Module, files: list[FilePlan], directory: Path) -> None:
    """``config.json`` (``dtype``: that of the floating-point weights written, as the model
    it loads into has) and ``generation_config.json``, as ``save_pretrained`` writes them."""
    dtypes = [s[0] for p in files for s in p.specs.values() if s[0].is_floating_point]
    config = model.config
    if dtypes:
        config.dtype = str(dtypes[0]).removeprefix("torch.")
    config.architectures = [type(model).__name__]
    config.save_pretrained(directory)
    if model.can_generate() and getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(directory)


def _remove_stale_shards(directory: Path, current: set[str]) -> None:
    """Shard files of an earlier save into the same folder that this save did not replace."""
    pattern = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")
    for path in directory.iterdir():
        if pattern.fullmatch(path.name) and path.name not in current:
            path.unlink()


def _size_limit(max_shard_size: int | str) -> int:
    if isinstance(max_shard_size, int):
        return max_shard_size
    from huggingface_hub.serialization._base import parse_size_to_int

    return parse_size_to_int(max_shard_size)


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return _numel((dtype, shape)) * dtype.itemsize


def _numel(spec: Spec) -> int:
    return torch.Size(spec[1]).numel()
