"""Build and load a model for ZeRO-3 without ever holding it whole on a rank.

``partitioned_init()`` (hf_zero's ``zero.Init``) builds the modules on the meta device, then
materialises them one module at a time: initialise the module's parameters, keep this rank's
slice of each unit's flat layout, free the rest. ``load_partitioned()`` fills those slices from
safetensors files, reading only the rows that overlap this rank's slice. ``initialize(stage=3)``
then adopts the slices, gathering one unit at a time to build its groups.

    with hf_zero.partitioned_init():
        model = AutoModelForCausalLM.from_config(config)
    hf_zero.load_partitioned(model, "path/to/checkpoint")   # optional
    engine = hf_zero.initialize(model, optimizer, stage=3)

A ``from_pretrained`` inside the block (with or without a bitsandbytes ``quantization_config``)
keeps each weight's slice as it loads (`hf_zero.sharding.stage3.partitioned_load`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from safetensors import safe_open

from hf_zero.comm.topology import current_device, init_distributed
from hf_zero.config.zero_config import ZeroConfig
from hf_zero.sharding.layout import FlatLayout
from hf_zero.sharding.stage3.coordinator import assign_params_to_units, find_units
from hf_zero.sharding.stage3.partitioned_load import PretrainedSlicer, keep_slice, slice_of
from hf_zero.storage import host_memory
from hf_zero.storage.safetensors import indexed_files

if TYPE_CHECKING:
    from hf_zero.comm import Collectives
    from hf_zero.comm.topology import Group


@dataclass
class PreShard:
    """This rank's slice of one unit's flat layout, made before `initialize` exists."""

    layout: FlatLayout
    shard: torch.Tensor  # fp32, ``layout.shard_numel`` elements
    params: list[torch.nn.Parameter]
    shard_index: int
    group: dist.ProcessGroup | None

    def gather_full(self, comm: Collectives, group: Group) -> torch.Tensor:
        """The unit's whole flat buffer (collective over ``group``, the whole world: the
        ranks it was sharded over), booked in ``comm``."""
        if self.layout.num_shards == 1:
            return self.shard.clone()
        full = torch.empty(
            self.layout.padded_numel, dtype=self.shard.dtype, device=self.shard.device
        )
        comm.all_gather(full, self.shard, group)
        return full


@contextlib.contextmanager
def partitioned_init(
    config: ZeroConfig | dict | str | None = None, **overrides
) -> Iterator[list[torch.nn.Module]]:
    """Models built (``from_config``, ``Model(config)``) or loaded (``from_pretrained``, also
    through bitsandbytes) in the block come out with their large parameters already sharded.

    Collective: every data-parallel rank must build the same model. Yields the list the built
    root modules are appended to. ``param_persistence_threshold`` (from ``config``) decides which
    parameters stay whole, as in `initialize`; the data-parallel group is the whole world.
    """
    cfg = ZeroConfig.load(config, **overrides)
    init_distributed(timeout=cfg.comm_timeout)
    if "nvme" in (cfg.offload_param, cfg.offload_optimizer) and current_device().type == "cpu":
        host_memory.unmap_large_frees()  # freed slices leave the process at once
    parents: dict[int, torch.nn.Module] = {}
    children: set[int] = set()
    order: list[torch.nn.Module] = []

    slicer = PretrainedSlicer(cfg)

    def on_module(module, name, submodule):
        if slicer.active:
            return  # a from_pretrained model: sliced as it loads
        for m in (module, submodule):
            if id(m) not in parents:
                parents[id(m)] = m
                order.append(m)
        children.add(id(submodule))

    def on_param(module, name, param):
        if not slicer.active and id(module) not in parents:
            parents[id(module)] = module
            order.append(module)

    hooks = [
        torch.nn.modules.module.register_module_module_registration_hook(on_module),
        torch.nn.modules.module.register_module_parameter_registration_hook(on_param),
    ]
    roots: list[torch.nn.Module] = []
    try:
        with slicer.patched(), torch.device("meta"):
            yield roots
    finally:
        for hook in hooks:
            hook.remove()
    built = [m for m in order if id(m) not in children]
    for root in built:
        partition_module(root, cfg)
    roots += built + slicer.loaded


def partition_module(root: torch.nn.Module, config: ZeroConfig) -> None:
    """Materialise a meta-device module one submodule at a time, keeping only shards."""
    device = current_device()
    world, rank = dist.get_world_size(), dist.get_rank()
    hidden = getattr(getattr(root, "config", None), "hidden_size", None)
    threshold = config.replace().resolve_auto(hidden_size=hidden).param_persistence_threshold
    found = find_units(root)
    owner = assign_params_to_units(root, [m for _, m in found])
    names = {}
    for name, p in root.named_parameters():
        names.setdefault(id(p), name)
    members: dict[int, list[torch.nn.Parameter]] = {}
    for p in dict.fromkeys(root.parameters()):
        if p.numel() >= threshold:
            members.setdefault(owner[id(p)], []).append(p)
    slot_of: dict[int, tuple[PreShard, int]] = {}
    for unit_index, params in members.items():
        layout = FlatLayout([names[id(p)] for p in params], [p.shape for p in params], world)
        shard = torch.zeros(layout.shard_numel, dtype=torch.float32, device=device)
        pre = PreShard(layout, shard, list(params), rank, None)
        found[unit_index][1]._hf_zero_preshard = pre
        for i, p in enumerate(params):
            slot_of[id(p)] = (pre, i)

    init_weights = getattr(root, "_init_weights", None)
    replaced: dict[int, torch.nn.Parameter] = {}
    for module in root.modules():
        touched, fresh = _materialize(module, device, replaced)
        if not touched:
            continue
        if init_weights is not None:
            with torch.no_grad():
                init_weights(module)
        elif hasattr(module, "reset_parameters"):
            module.reset_parameters()
        elif next(module.parameters(recurse=False), None) is not None:
            raise ValueError(
                f"hf_zero.partitioned_init: cannot initialise {type(module).__name__}: it has no "
                "reset_parameters() and the root model has no _init_weights()"
            )
        for old_id, p in fresh:
            if old_id not in slot_of:
                continue
            pre, i = slot_of[old_id]
            slot = pre.layout.slots[i]
            pre.params[i] = p
            p._hf_zero_slot = (pre, slot)
            _copy_into_shard(pre, slot, p.detach().reshape(-1).float())
            p.data = torch.empty(0, dtype=p.dtype, device=device)
    _check_nothing_meta(root)


def _materialize(
    module: torch.nn.Module, device: torch.device, replaced: dict[int, torch.nn.Parameter]
) -> tuple[bool, list[tuple[int, torch.nn.Parameter]]]:
    """Swap this module's own meta tensors for uninitialised real ones.

    A meta parameter cannot change device in place, so it is replaced by a new Parameter;
    ``replaced`` maps old to new so that tied weights stay one object. Returns whether anything
    was swapped, and the parameters created here (not those reused through ``replaced``), each
    with the id of the meta parameter it replaces.
    """
    touched = False
    created = []
    for name, p in list(module._parameters.items()):
        if p is None or not p.is_meta:
            continue
        if id(p) not in replaced:
            new = torch.nn.Parameter(torch.empty_like(p, device=device), p.requires_grad)
            replaced[id(p)] = new
            created.append((id(p), new))
        module._parameters[name] = replaced[id(p)]
        touched = True
    for name, b in list(module._buffers.items()):
        if b is not None and b.is_meta:
            module._buffers[name] = torch.empty_like(b, device=device)
            touched = True
    return touched, created


def _check_nothing_meta(root: torch.nn.Module) -> None:
    """After materialisation nothing may remain on the meta device."""
    left = [n for n, t in root.named_parameters() if t.is_meta]
    left += [n for n, t in root.named_buffers() if t.is_meta]
    if left:
        raise ValueError(f"hf_zero.partitioned_init: tensors left uninitialised: {left[:5]}")


def _copy_into_shard(pre: PreShard, slot, flat_values: torch.Tensor) -> None:
    """Copy the part of one parameter that falls inside this rank's shard."""
    start, end = pre.layout.shard_range(pre.shard_index)
    lo, hi = max(slot.offset, start), min(slot.end, end)
    if lo < hi:
        pre.shard[lo - start : hi - start].copy_(flat_values[lo - slot.offset : hi - slot.offset])


def is_partitioned(model: torch.nn.Module) -> bool:
    """True while ``model`` holds `partitioned_init` slices (before `initialize` adopts them)."""
    return any(
        getattr(p, "_hf_zero_slot", None) is not None or slice_of(p) is not None
        for p in model.parameters()
    )


def preshard_of(module: torch.nn.Module) -> PreShard | None:
    """The module's own pre-shard (never one found through a wrapper's attribute forwarding:
    a PEFT model answers for its base model's attributes)."""
    return module.__dict__.get("_hf_zero_preshard")


# ----------------------------------------------------------------------------------------------
# loading safetensors slices
# ----------------------------------------------------------------------------------------------


def load_partitioned(model: torch.nn.Module, path: str | Path) -> dict[str, int]:
    """Load a safetensors checkpoint (file or directory) into a `partitioned_init` model.

    Each rank reads, for every sharded parameter, only the rows that overlap its slice; small
    whole parameters and buffers are read in full. Returns counts for inspection:
    ``{"elements_read": ..., "elements_total": ...}``.
    """
    files = _tensor_files(Path(path))
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    read = total = 0
    handles = {f: safe_open(f, framework="pt", device="cpu") for f in set(files.values())}
    seen: set[int] = set()
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        key = next((n for n in aliases[id(p)] if n in files), None)
        if key is None:
            raise ValueError(
                f"hf_zero.load_partitioned: no tensor for parameter {aliases[id(p)][0]} in {path}"
            )
        handle = handles[files[key]]
        if slice_of(p) is not None:  # a partitioned from_pretrained's weight: sliced alone
            if slice_of(p).views is not None:
                raise NotImplementedError(
                    f"hf_zero.load_partitioned: '{key}' is a bitsandbytes weight; load the "
                    "quantized model again with from_pretrained inside partitioned_init()"
                )
            tensor = handle.get_tensor(key).to(p.dtype)
            p._hf_zero_slice = slice_of(keep_slice(key, torch.nn.Parameter(tensor, False)))
            read += tensor.numel()
            total += tensor.numel()
            continue
        slot_info = getattr(p, "_hf_zero_slot", None)
        if slot_info is None:
            tensor = handle.get_tensor(key)
            with torch.no_grad():
                p.copy_(tensor.to(p.dtype))
            read += tensor.numel()
            total += tensor.numel()
            continue
        pre, slot = slot_info
        values, count = _read_range(handle, key, slot, pre)
        total += slot.numel
        read += count
        if values is not None:
            start, _ = pre.layout.shard_range(pre.shard_index)
            lo = max(slot.offset, start)
            pre.shard[lo - start : lo - start + values.numel()].copy_(values)
    for name, buf in model.named_buffers():
        if name in files:
            with torch.no_grad():
                buf.copy_(handles[files[name]].get_tensor(name).to(buf.dtype))
    return {"elements_read": read, "elements_total": total}


def _read_range(handle, key: str, slot, pre: PreShard) -> tuple[torch.Tensor | None, int]:
    """The elements of ``key`` inside this rank's shard, reading whole rows only around them."""
    start, end = pre.layout.shard_range(pre.shard_index)
    lo, hi = max(slot.offset, start) - slot.offset, min(slot.end, end) - slot.offset
    if lo >= hi:
        return None, 0
    shape = tuple(slot.shape)
    row = 1
    for dim in shape[1:]:
        row *= dim
    first, last = lo // row, (hi - 1) // row + 1
    rows = handle.get_slice(key)[first:last] if shape else handle.get_tensor(key)
    flat = rows.reshape(-1).float()
    offset = lo - first * row
    return flat[offset : offset + (hi - lo)], flat.numel()


def _tensor_files(path: Path) -> dict[str, str]:
    """Map each tensor name to the safetensors file holding it."""
    if path.is_file():
        with safe_open(str(path), framework="pt") as f:
            return {k: str(path) for k in f.keys()}  # noqa: SIM118
    index = path / "model.safetensors.index.json"
    if index.exists():
        return {k: str(v) for k, v in indexed_files(path, index).items()}
    single = path / "model.safetensors"
    if single.exists():
        return _tensor_files(single)
    raise ValueError(f"hf_zero.load_partitioned: no safetensors checkpoint at {path}")


def unshard(module: torch.nn.Module, comm: Collectives, group: Group) -> None:
    """Give a `partitioned_init` unit's parameters their whole values again (collective over
    ``group``, booked in ``comm``).

    `initialize` calls it one unit at a time: stage 3 re-shards the unit right away, so at most
    one unit is ever whole; stages 0-2 keep the parameters whole.
    """
    pre = preshard_of(module)
    if pre is None:
        return
    full = pre.gather_full(comm, group)
    for slot, p in zip(pre.layout.slots, pre.params):
        p.data = full[slot.offset : slot.end].view(slot.shape).to(p.dtype, copy=True)
        del p._hf_zero_slot
    del module._hf_zero_preshard
