"""The whole model's weights out of a sharded engine, one group at a time (collective).

`state_dict_pieces` is the one walk every export takes: each group is gathered, its tensors
copied out to CPU and the group released before the next, then the tensors no group holds
(small whole parameters, buffers). Under stage 3 a rank so holds one group's weights at a time.
`full_state_dict` and `saved_state_dict` collect the pieces into one dict (the whole model on
rank 0); the streamed ``save_pretrained`` (`hf_zero.engine.pretrained_save`) writes each piece
to its file and drops it, and the training record's base fingerprint samples each piece.

A bitsandbytes weight's quantization state is read while its group is gathered: its ``absmax``
is sharded with its codes (`hf_zero.numerics.packed.PackedViews`) and empty in between.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hf_zero.sharding.stage3.gathered import gathered

if TYPE_CHECKING:
    from hf_zero.engine.state_view import EngineState
    from hf_zero.sharding.flat_group import FlatParamGroup

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Export:
    """What an export takes from the engine.

    ``master_weights``: trainable parameters from their fp32 master weights. ``original_dtypes``:
    each parameter cast back to the dtype it had before training (what ``save_model`` writes).
    ``only_trainable``: trainable parameters only (an adapter save). ``keep``: this rank keeps
    the tensors (the others take part in the gathers and get empty pieces).
    """

    master_weights: bool = False
    original_dtypes: bool = False
    only_trainable: bool = False
    keep: bool = True


def saved_export(engine: EngineState, keep: bool, only_trainable: bool = False) -> Export:
    """What ``save_model`` writes: each parameter in the dtype it had before training, trainable
    ones from their fp32 master weights (an fp32 model trained with ``--bf16`` under autocast
    stays fp32); with the config's ``save_16bit_model`` the parameters as trained."""
    if engine.config.save_16bit_model:
        return Export(keep=keep, only_trainable=only_trainable)
    return Export(True, True, only_trainable, keep)


def state_dict_pieces(engine: EngineState, export: Export) -> Iterator[dict[str, torch.Tensor]]:
    """The model's state dict in pieces: one per group (gathered, copied to CPU, released),
    then one of everything else. Collective: every rank must consume every piece. Tied keys
    share one tensor within a piece."""
    tp = engine.tp  # TP-split tensors are gathered over the TP group: every rank takes part
    keys = keys_by_param(engine.module)
    widened: list[str] = []

    def whole(p: torch.Tensor, value: torch.Tensor) -> torch.Tensor | None:
        shard = tp.shard_of(p) if tp is not None else None
        if shard is not None:
            value = tp.gather_full(value, shard)
        if not export.keep:
            return None
        names = keys.get(id(p)) if export.original_dtypes else None
        dtype = engine.loaded_dtypes.get(names[0]) if names else None
        if dtype is not None and value.is_floating_point() and value.dtype != dtype:
            if not p.requires_grad and dtype.itemsize > value.dtype.itemsize:
                widened.append(keys[id(p)][0])
            return value.to("cpu", dtype)
        return value.to("cpu", copy=True)

    done: set[int] = set()
    produced: set[str] = set()  # a bitsandbytes weight's quantization state comes with it
    for group in exported_groups(engine, export):
        piece = {}
        for p, value in _group_values(group, export.master_weights):
            done.add(id(p))
            copy = whole(p, value)
            piece.update({key: copy for key in keys.get(id(p), ())})
            if group.packed is not None:
                quant_state = _quant_state_entries(p, keys.get(id(p), ()))
                produced.update(quant_state)
                piece.update(quant_state)
        yield piece if export.keep else {}
    rest: dict[int, torch.Tensor | None] = {}
    piece = {}
    names = dict(engine.module.named_parameters(remove_duplicate=False))
    for key, tensor in engine.module.state_dict(keep_vars=True).items():
        p = names.get(key)
        if key in piece or key in produced or (p is not None and id(p) in done):
            continue
        if p is not None and export.only_trainable and not p.requires_grad:
            continue
        if p is None and export.only_trainable:
            continue  # buffers belong to the base
        source = p if p is not None else tensor
        if id(source) not in rest:  # tied keys: copied once
            rest[id(source)] = whole(source, tensor.detach())
        piece[key] = rest[id(source)]
    yield piece if export.keep else {}
    if widened and not hasattr(engine.module, "peft_config"):  # PEFT saves adapters only
        logger.warning(
            "hf_zero: %d frozen parameters (first: %s) were held in %s during training; they "
            "are saved as those values in their original dtype (the original values are not "
            "kept)",
            len(widened), sorted(widened)[0], engine.dtype,
        )  # fmt: skip


def exported_groups(engine: EngineState, export: Export) -> list[FlatParamGroup]:
    """The groups an export gathers, in the order it gathers them."""
    groups = engine.groups + engine.frozen_groups
    return [g for g in groups if g.trainable or not export.only_trainable]


def _group_values(
    group: FlatParamGroup, master_weights: bool
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each parameter of ``group`` with its whole value, while the group is gathered."""
    full32 = group.full_master() if master_weights and group.trainable else None
    if full32 is not None and group.packed is None:  # the master is all it needs
        for slot, p in zip(group.layout.slots, group.params):
            yield p, full32[slot.offset : slot.end].view(slot.shape)
        return
    with gathered([group]):
        for slot, p in zip(group.layout.slots, group.params):
            source = p if full32 is None else full32[slot.offset : slot.end]
            yield p, source.detach().view(p.shape)


def collect(pieces: Iterator[dict[str, torch.Tensor]], order: list[str]) -> dict:
    """The pieces as one dict, its keys in ``order`` (the module's state-dict order)."""
    merged: dict[str, torch.Tensor] = {}
    for piece in pieces:
        merged.update(piece)
    return {key: merged[key] for key in order if key in merged}


def full_state_dict(
    engine: EngineState, rank0_only: bool = True, master_weights: bool = False
) -> dict[str, torch.Tensor]:
    """See `ZeroEngine.full_state_dict`."""
    keep = not rank0_only or engine.topology.rank == 0
    export = Export(master_weights=master_weights, keep=keep)
    state = collect(state_dict_pieces(engine, export), _state_dict_keys(engine.module))
    return state if keep else {}


def saved_state_dict(
    engine: EngineState, rank0_only: bool = True, only_trainable: bool = False
) -> dict[str, torch.Tensor]:
    """What a saved model holds (collective; ``{}`` off rank 0 with ``rank0_only``), see
    `saved_export`. ``only_trainable``: the trainable parameters only (what an adapter save
    writes), so the frozen base is never gathered."""
    keep = not rank0_only or engine.topology.rank == 0
    export = saved_export(engine, keep, only_trainable)
    state = collect(state_dict_pieces(engine, export), _state_dict_keys(engine.module))
    return state if keep else {}


def _state_dict_keys(model: torch.nn.Module) -> list[str]:
    return list(model.state_dict(keep_vars=True))


def keys_by_param(model: torch.nn.Module) -> dict[int, list[str]]:
    """Each parameter's state-dict keys (``<module>.weight``; several when tied), by id."""
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for attr, p in module._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append(f"{name}.{attr}" if name else attr)
    return owners


def _quant_state_entries(p: torch.Tensor, prefixes) -> dict[str, torch.Tensor]:
    state = getattr(p, "quant_state", None)
    if state is None or not hasattr(state, "as_dict"):
        return {}
    packed = state.as_dict(packed=True)
    return {
        f"{prefix}.{k}": v.detach().to("cpu", copy=True)
        for prefix in prefixes
        for k, v in packed.items()
        if torch.is_tensor(v)
    }
