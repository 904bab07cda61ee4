"""``from_pretrained`` inside `partitioned_init()`: every weight is kept as this rank's slice.

transformers builds the model on the meta device, then loads the checkpoint one weight at a
time (quantizing it first for a bitsandbytes ``quantization_config``) and registers each on its
module. While a ``from_pretrained`` runs inside `partitioned_init()`, a parameter registration
hook takes each weight as it arrives, keeps this rank's slice of it (its values, or for a
bitsandbytes weight the bytes of its codes and scales) and leaves an empty parameter in its
place; the whole weight is freed before the next one is read. So no rank ever holds more than
one whole weight besides its slices, and the bytes kept are exactly those of a whole load.

`initialize` gathers the slices back one unit at a time (`unshard_params`) and builds its
groups from them, as for a model built by `partitioned_init()` from a config.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from hf_zero.comm.topology import current_device
from hf_zero.config.zero_config import ZeroConfig
from hf_zero.numerics.packed import PackedViews, as_bytes, is_packed
from hf_zero.sharding.layout import FlatLayout
from hf_zero.storage import host_memory

if TYPE_CHECKING:
    from hf_zero.comm import Collectives
    from hf_zero.comm.topology import Group


@dataclass
class ParamSlice:
    """This rank's part of one parameter laid out alone over the world's ranks: its values in
    their own dtype, or (``views`` set) the bytes of a bitsandbytes weight's codes and scales.
    ``checksum``: CRC-32 of the whole weight's bytes as this rank loaded them."""

    layout: FlatLayout
    shard: torch.Tensor
    shape: torch.Size
    views: PackedViews | None
    checksum: int

    @property
    def numel(self) -> int:
        """Elements of the whole parameter (its codes, for a bitsandbytes weight)."""
        return self.shape.numel()


def slice_of(param: torch.Tensor) -> ParamSlice | None:
    """The slice a partitioned ``from_pretrained`` left on ``param``, if any."""
    return param.__dict__.get("_hf_zero_slice")


def crc32(data: torch.Tensor) -> int:
    """CRC-32 of a 1-D ``uint8`` tensor (read in 64 MiB pieces from a device)."""
    if data.device.type == "cpu":
        return zlib.crc32(data.contiguous().numpy())
    value = 0
    for piece in data.split(64 << 20):
        value = zlib.crc32(piece.cpu().numpy(), value)
    return value


def keep_slice(name: str, param: torch.nn.Parameter) -> torch.nn.Parameter:
    """Keep this rank's slice of ``param`` and return the parameter to register in its place
    (``param`` itself, emptied, for a bitsandbytes weight, whose quantization state stays on it;
    a new empty parameter otherwise)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if is_packed(param):
        views = PackedViews([param])
        layout = FlatLayout([name], views.byte_shapes(), world)
        whole = torch.zeros(layout.padded_numel, dtype=torch.uint8, device=param.device)
        views.fill(whole, layout.slots, [param])  # small: codes and scales
        placeholder = param
        if hasattr(param, "CB"):  # Int8Params: CB is a second reference to the whole codes
            param.CB = None
    else:
        views = None
        layout = FlatLayout([name], [param.shape], world)
        whole = param.detach().reshape(-1)
        placeholder = torch.nn.Parameter(
            torch.empty(0, dtype=param.dtype, device=param.device), param.requires_grad
        )
        placeholder.__dict__.update(
            {k: v for k, v in param.__dict__.items() if k == "_is_hf_initialized"}
        )
    start, end = layout.shard_range(rank)
    shard = torch.zeros(layout.shard_numel, dtype=whole.dtype, device=param.device)
    if start < layout.numel:
        shard[: min(end, layout.numel) - start].copy_(whole[start : min(end, layout.numel)])
    checksum = crc32(as_bytes(whole[: layout.numel]))
    shape = param.shape
    if views is not None:
        views.release([param], param.device)
    placeholder._hf_zero_slice = ParamSlice(layout, shard, shape, views, checksum)
    return placeholder


def unshard_params(params: list[torch.Tensor], comm: Collectives, group: Group) -> None:
    """Give each sliced parameter its whole value again (collective over ``group``, the ranks
    it was sliced over: one all-gather per parameter, in the order given, booked in ``comm``).

    The bytes gathered from the other ranks are checked against the checksum of what this rank
    loaded; one small all-reduce at the end makes every rank raise together if any differs
    (ranks that loaded different checkpoints, or a slice changed in memory since).
    """
    params = [p for p in params if slice_of(p) is not None]
    if not params:
        return
    mismatched = []
    for p in params:
        piece = slice_of(p)
        full = torch.empty(piece.layout.padded_numel, dtype=piece.shard.dtype, device=p.device)
        if piece.layout.num_shards == 1:
            full.copy_(piece.shard)
        else:
            comm.all_gather(full, piece.shard, group)
        if crc32(as_bytes(full[: piece.layout.numel])) != piece.checksum:
            mismatched.append(piece.layout.slots[0].name)
        if piece.views is not None:
            piece.views.point(full, piece.layout.slots, [p])
            if hasattr(p, "CB") and getattr(p, "_hf_zero_int8_module", None) is None:
                p.CB = p.data  # as bitsandbytes leaves a loaded Int8Params
        else:
            whole = full[: piece.numel].view(piece.shape)
            p.data = whole.to(p.dtype, copy=True)  # the dtype the model has now (may be cast)
        del p._hf_zero_slice
    flag = torch.tensor([len(mismatched)], dtype=torch.int32, device=current_device())
    comm.all_reduce_max(flag, group)
    if flag.item():
        raise ValueError(
            "hf_zero.partitioned_init: the slices gathered for "
            f"{mismatched[:3] or 'weights of another rank'} do not match what this rank loaded "
            "(checksums differ): every rank must load the same checkpoint; load it again"
        )


class PretrainedSlicer:
    """While active, slices every weight a ``from_pretrained`` registers (see module doc)."""

    def __init__(self, config: ZeroConfig) -> None:
        self.config = config
        self.active = False
        self.parent: dict[int, torch.nn.Module] = {}
        self.threshold: dict[int, int] = {}
        self.loaded: list[torch.nn.Module] = []
        self.bytes = {"whole": 0, "kept": 0}

    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        """``PreTrainedModel.from_pretrained`` runs partitioned for the duration."""
        from transformers import PreTrainedModel

        original = PreTrainedModel.__dict__["from_pretrained"]
        slicer = self

        @functools.wraps(original.__func__)
        def from_pretrained(cls, *args, **kwargs):
            return slicer.load(original.__func__, cls, *args, **kwargs)

        PreTrainedModel.from_pretrained = classmethod(from_pretrained)
        try:
            yield
        finally:
            PreTrainedModel.from_pretrained = original

    def load(self, original, cls, *args, **kwargs):
        """Run ``original`` with real tensors on this rank's device and every registered weight
        sliced; then slice what transformers set without registering, and check nothing is
        left on the meta device."""
        if self.active:  # a from_pretrained calling another: the outer one slices
            return original(cls, *args, **kwargs)
        hooks = [
            torch.nn.modules.module.register_module_module_registration_hook(self._on_module),
            torch.nn.modules.module.register_module_parameter_registration_hook(self._on_param),
        ]
        self.active = True
        if current_device().type == "cpu":
            # Each whole weight is a temporary: give its memory back when it is freed, or the
            # heap keeps the peak of the largest weights read so far.
            host_memory.unmap_large_frees()
        try:
            # transformers refuses from_pretrained under a meta device context; the model is
            # built on meta by transformers itself, and loaded weights land on this device.
            with torch.device(current_device()):
                model = original(cls, *args, **kwargs)
        finally:
            self.active = False
            for hook in hooks:
                hook.remove()
            self.parent.clear()
        self._slice_rest(model)
        if current_device().type == "cpu":
            host_memory.trim()
        self.loaded.append(model)
        if dist.get_rank() == 0:
            whole, kept = self.bytes["whole"] / 2**20, self.bytes["kept"] / 2**20
            print(
                f"hf_zero: {type(model).__name__}.from_pretrained inside partitioned_init: "
                f"each rank keeps its slices, {kept:.1f} MiB of the weights' {whole:.1f} MiB",
                file=sys.stderr,
                flush=True,
            )
        self.bytes = {"whole": 0, "kept": 0}
        return model

    def _on_module(self, module, name, submodule) -> None:
        if submodule is not None:
            self.parent[id(submodule)] = module

    def _on_param(self, module, name, param):
        if param is None or param.is_meta or slice_of(param) is not None:
            return None
        if param.numel() < self._threshold_for(module):
            return None
        return self._keep(name, param)

    def _keep(self, name: str, param: torch.nn.Parameter) -> torch.nn.Parameter:
        placeholder = keep_slice(name, param)
        piece = slice_of(placeholder)
        self.bytes["whole"] += piece.layout.numel * piece.shard.element_size()
        self.bytes["kept"] += piece.shard.nbytes
        return placeholder

    def _threshold_for(self, module: torch.nn.Module) -> int:
        """``param_persistence_threshold`` for the model ``module`` belongs to (``auto``
        resolves from its root's ``hidden_size``)."""
        root = module
        while id(root) in self.parent:
            root = self.parent[id(root)]
        if id(root) not in self.threshold:
            hidden = getattr(getattr(root, "config", None), "hidden_size", None)
            resolved = self.config.resolved(hidden_size=hidden)
            self.threshold[id(root)] = resolved.param_persistence_threshold
        return self.threshold[id(root)]

    def _slice_rest(self, model: torch.nn.Module) -> None:
        """Weights transformers set in place (missing keys it initialised) are sliced here."""
        threshold = self._threshold_for(model)
        self.threshold.clear()
        replaced: dict[int, torch.nn.Parameter] = {}  # tied weights stay one parameter
        for module_name, module in model.named_modules():
            for name, p in list(module._parameters.items()):
                if p is None:
                    continue
                if p.is_meta:
                    raise ValueError(
                        f"hf_zero.partitioned_init: from_pretrained left "
                        f"'{module_name}.{name}' on the meta device"
                    )
                if id(p) not in replaced and slice_of(p) is None and p.numel() >= threshold:
                    replaced[id(p)] = self._keep(name, p)
                module._parameters[name] = replaced.get(id(p), p)
