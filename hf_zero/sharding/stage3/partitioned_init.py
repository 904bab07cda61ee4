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

from hf_zero.comm.topology import current_device, init_distributed
from hf_zero.config.zero_config import ZeroConfig
from hf_zero.sharding.layout import FlatLayout
from hf_zero.sharding.stage3.partitioned_load import PretrainedSlicer, keep_slice, slice_of
from hf_zero.sharding.stage3.units import assign_params_to_units, find_units
from hf_zero.storage import host_memory
from hf_zero.storage.safetensors import SafetensorsSliceReader, indexed_files
from hf_zero.storage.swap import SwapFile, SwapSpace, check_nvme_path, open_space

if TYPE_CHECKING:
    from hf_zero.comm import Collectives
    from hf_zero.comm.topology import Group


@dataclass
class PreShard:
    """This rank's slice of one unit's flat layout, made before `initialize` exists.

    With a ``swap`` space (NVMe offload configured) the slice goes to a swap file as soon as all
    of the unit's parameters are in (`fill`), so a build holds one unit's slice at a time.
    """

    layout: FlatLayout
    shard: torch.Tensor | None  # fp32, ``layout.shard_numel`` elements (`open`, `fill`)
    params: list[torch.nn.Parameter]
    shard_index: int
    group: dist.ProcessGroup | None
    swap: SwapSpace | None = None
    file: SwapFile | None = None
    filled: int = 0

    def values(self) -> torch.Tensor:
        """The slice: in memory, or read back from its swap file (a fresh buffer)."""
        if self.file is None:
            return self.shard
        return self.file.read(self.swap.buffer(self.layout.shard_numel, torch.float32))

    def store(self, values: torch.Tensor) -> None:
        """Keep ``values`` (from `values`, changed) as the slice: back to the swap file when
        it has one."""
        if self.file is None:
            self.shard = values
        else:
            self.file.write(values)

    def open(self, device: torch.device) -> torch.Tensor:
        """The slice being filled, zeros until then (made when its unit's first parameter is
        materialised: with a swap space, only one unit's slice is in memory at a time)."""
        if self.shard is None:
            if self.swap is None:
                self.shard = torch.zeros(
                    self.layout.shard_numel, dtype=torch.float32, device=device
                )
            else:  # aligned, so it is written to the swap file as it is
                self.shard = self.swap.buffer(self.layout.shard_numel, torch.float32).zero_()
        return self.shard

    def fill(self) -> None:
        """One more parameter is in; with all in, a swapped slice leaves memory."""
        self.filled += 1
        if self.swap is not None and self.filled == len(self.params):
            self.file = self.swap.file("preshard", self.shard.nbytes)
            self.file.write(self.shard)
            self.shard = None

    def drop(self) -> None:
        """`initialize` has adopted the slice: free it and its swap file."""
        self.shard = None
        if self.file is not None:
            self.swap.remove(self.file)
            self.file = None

    def gather_full(self, comm: Collectives, group: Group) -> torch.Tensor:
        """The unit's whole flat buffer (collective over ``group``, the whole world: the
        ranks it was sharded over), booked in ``comm``."""
        shard = self.values()
        if self.layout.num_shards == 1:
            return shard.clone()
        full = torch.empty(self.layout.padded_numel, dtype=shard.dtype, device=shard.device)
        comm.all_gather(full, shard, group)
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
    swap = _spill_space(cfg)
    for root in built:
        partition_module(root, cfg, swap)
    roots += built + slicer.loaded


def _spill_space(config: ZeroConfig) -> SwapSpace | None:
    """Where slices go while the model is built: the swap space of the NVMe tier, if any (on
    a CPU device; on an accelerator the slices are in device memory already)."""
    tier = next((t for t in ("offload_param", "offload_optimizer") if getattr(config, t) == "nvme"), None)  # fmt: skip
    if tier is None or current_device().type != "cpu":
        return None
    root = check_nvme_path(f"{tier}.nvme_path", config.nvme_path_for(tier))
    return open_space(root, dist.get_rank(), config.nvme_io_threads, hold=False)


def partition_module(
    root: torch.nn.Module, config: ZeroConfig, swap: SwapSpace | None = None
) -> None:
    """Materialise a meta-device module one submodule at a time, keeping only shards (each
    unit's in a swap file of ``swap`` once complete)."""
    device = current_device()
    world, rank = dist.get_world_size(), dist.get_rank()
    hidden = getattr(getattr(root, "config", None), "hidden_size", None)
    threshold = config.resolved(hidden_size=hidden).param_persistence_threshold
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
        pre = PreShard(layout, None, list(params), rank, None, swap)
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
            pre.fill()
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
    shard = pre.open(flat_values.device)
    if lo < hi:
        shard[lo - start : hi - start].copy_(flat_values[lo - slot.offset : hi - slot.offset])


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
    # Positioned reads: a memory map would bring every page a rank touches into its RSS.
    handles = {f: SafetensorsSliceReader(Path(f)) for f in set(files.values())}
    seen: set[int] = set()
    editing: list[tuple[PreShard, torch.Tensor]] = []  # one slice at a time (it may be swapped)
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
            tensor = handle.tensor(key).to(p.dtype)
            p._hf_zero_slice = slice_of(keep_slice(key, torch.nn.Parameter(tensor, False)))
            read += tensor.numel()
            total += tensor.numel()
            continue
        slot_info = getattr(p, "_hf_zero_slot", None)
        if slot_info is None:
            tensor = handle.tensor(key)
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
            if not editing or editing[0][0] is not pre:
                _store(editing)
                editing.append((pre, pre.values()))
            start, _ = pre.layout.shard_range(pre.shard_index)
            lo = max(slot.offset, start)
            editing[0][1][lo - start : lo - start + values.numel()].copy_(values)
    _store(editing)
    for name, buf in model.named_buffers():
        if name in files:
            with torch.no_grad():
                buf.copy_(handles[files[name]].tensor(name).to(buf.dtype))
    return {"elements_read": read, "elements_total": total}


def _store(editing: list[tuple[PreShard, torch.Tensor]]) -> None:
    for pre, values in editing:
        pre.store(values)
    editing.clear()


def _read_range(
    reader: SafetensorsSliceReader, key: str, slot, pre: PreShard
) -> tuple[torch.Tensor | None, int]:
    """The elements of ``key`` inside this rank's shard (only those are read)."""
    start, end = pre.layout.shard_range(pre.shard_index)
    lo, hi = max(slot.offset, start) - slot.offset, min(slot.end, end) - slot.offset
    if lo >= hi:
        return None, 0
    if list(reader.shape(key)) != list(slot.shape):
        raise ValueError(
            f"hf_zero.load_partitioned: '{key}' has shape {reader.shape(key)} in "
            f"{reader.path}, the model's is {list(slot.shape)}"
        )
    return reader.read(key, lo, hi).float(), hi - lo


def _tensor_files(path: Path) -> dict[str, str]:
    """Map each tensor name to the safetensors file holding it."""
    if path.is_file():
        return dict.fromkeys(SafetensorsSliceReader(path).keys(), str(path))
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
    pre.drop()
    del module._hf_zero_preshard
