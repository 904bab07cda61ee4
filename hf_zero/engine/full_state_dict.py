"""`full_state_dict`: the whole model's state dict on CPU, gathered group by group (collective).

What ``save_pretrained`` and the merged export need from a sharded engine. Under stage 3 each
group is gathered, copied out and released in turn, so device memory grows by one group at a
time. A bitsandbytes weight's quantization state is read while its group is gathered: its
``absmax`` is sharded with its codes (`hf_zero.numerics.packed.PackedViews`) and empty in between.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from hf_zero.sharding.stage3.gathered import gathered

if TYPE_CHECKING:
    from hf_zero.engine.zero_engine import ZeroEngine

logger = logging.getLogger(__name__)


def saved_state_dict(engine: ZeroEngine, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """What a saved model holds (collective): each parameter in the dtype it had before
    training, trainable ones from their fp32 master weights, as the same script saves without
    hf_zero (an fp32 model trained with ``--bf16`` under autocast stays fp32). With the config's
    ``save_16bit_model``: the parameters as trained, at the training precision."""
    if engine.config.save_16bit_model:
        return full_state_dict(engine, rank0_only)
    state = full_state_dict(engine, rank0_only, master_weights=True)
    names = dict(engine.module.named_parameters(remove_duplicate=False))
    cast: dict[int, torch.Tensor] = {}  # tied keys stay one tensor
    widened = set()
    for key, value in state.items():
        p = names.get(key)
        dtype = engine.loaded_dtypes.get(id(p)) if p is not None else None
        if dtype is None or not value.is_floating_point() or value.dtype == dtype:
            continue
        if id(value) not in cast:
            cast[id(value)] = value.to(dtype)
        state[key] = cast[id(value)]
        if not p.requires_grad and dtype.itemsize > value.dtype.itemsize:
            widened.add(key)
    if widened and not hasattr(engine.module, "peft_config"):  # PEFT saves adapters only
        logger.warning(
            "hf_zero: %d frozen parameters (first: %s) were held in %s during training; they "
            "are saved as those values in their original dtype (the original values are not "
            "kept)",
            len(widened), sorted(widened)[0], engine.dtype,
        )  # fmt: skip
    return state


def full_state_dict(
    engine: ZeroEngine, rank0_only: bool = True, master_weights: bool = False
) -> dict[str, torch.Tensor]:
    """See `ZeroEngine.full_state_dict`."""
    keep = not rank0_only or engine.topology.rank == 0
    tp = engine.tp  # TP-split tensors are gathered over the TP group: every rank takes part

    def whole(p: torch.Tensor, value: torch.Tensor) -> torch.Tensor | None:
        shard = tp.shard_of(p) if tp is not None else None
        if shard is not None:
            value = tp.gather_full(value, shard)
        return value.to("cpu", copy=True) if keep else None

    owners = _state_dict_prefixes(engine.module)
    values: dict[int, torch.Tensor] = {}
    extras: dict[str, torch.Tensor] = {}  # quantization state read while gathered
    for group in engine.groups + engine.frozen_groups:
        full32 = group.full_master() if master_weights and group.trainable else None
        with gathered([group]):
            if keep or tp is not None:
                for slot, p in zip(group.layout.slots, group.params):
                    source = p if full32 is None else full32[slot.offset : slot.end]
                    values[id(p)] = whole(p, source.detach().view(p.shape))
                    if group.packed is not None and keep:
                        extras.update(_quant_state_entries(p, owners.get(id(p), ())))
    if not keep and tp is None:
        return {}
    names = dict(engine.module.named_parameters(remove_duplicate=False))
    state = {}
    for key, tensor in engine.module.state_dict(keep_vars=True).items():
        p = names.get(key)
        if key in extras:
            state[key] = extras[key]
        elif p is not None and id(p) in values:
            state[key] = values[id(p)]
        else:
            if p is not None:
                values[id(p)] = whole(p, tensor.detach())  # tied keys: gathered once
            state[key] = values[id(p)] if p is not None else whole(tensor, tensor.detach())
    return state if keep else {}


def _state_dict_prefixes(model: torch.nn.Module) -> dict[int, list[str]]:
    """Each parameter's state-dict prefixes (``<module>.weight``), by parameter id."""
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
