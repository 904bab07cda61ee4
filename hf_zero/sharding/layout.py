"""Layout math: flat padded buffers, shard ranges, and the grouping of parameters into buckets.

Pure functions and small value objects: no process groups, no tensors held. ``flat_group.py``
binds a layout to real parameters and buffers.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

# Every flat buffer is padded to a multiple of ``num_shards * ALIGN`` elements so that each shard
# starts 16-byte aligned for 16-bit dtypes (friendlier to NCCL and vectorised kernels).
ALIGN = 8


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives inside a flat buffer."""

    name: str
    offset: int
    numel: int
    shape: torch.Size

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class ShardPiece:
    """The part of one parameter that falls inside one shard."""

    slot: ParamSlot
    param_start: int  # first element of the parameter (flattened) inside the shard
    shard_start: int  # where that element sits in the shard
    numel: int


class FlatLayout:
    """Parameters laid end to end in one buffer, padded, and cut into ``num_shards`` equal shards."""

    def __init__(self, names: Sequence[str], shapes: Sequence[torch.Size], num_shards: int) -> None:
        if num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {num_shards}")
        slots, offset = [], 0
        for name, shape in zip(names, shapes, strict=True):
            numel = int(torch.Size(shape).numel())
            slots.append(ParamSlot(name, offset, numel, torch.Size(shape)))
            offset += numel
        self.slots: tuple[ParamSlot, ...] = tuple(slots)
        self.numel = offset
        self.num_shards = num_shards
        unit = num_shards * ALIGN
        self.padded_numel = max(unit, -(-offset // unit) * unit)
        self.shard_numel = self.padded_numel // num_shards

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    def shard_range(self, shard_index: int) -> tuple[int, int]:
        """``[start, end)`` of shard ``shard_index`` in the flat buffer."""
        start = shard_index * self.shard_numel
        return start, start + self.shard_numel

    def shard_pieces(self, shard_index: int) -> list[ShardPiece]:
        """The parameter pieces inside one shard, in order (padding excluded)."""
        start, end = self.shard_range(shard_index)
        pieces = []
        for slot in self.slots:
            lo, hi = max(slot.offset, start), min(slot.end, end)
            if lo < hi:
                pieces.append(ShardPiece(slot, lo - slot.offset, lo - start, hi - lo))
        return pieces


def bucket_params(
    items: Sequence[tuple[Hashable, object]], bucket_numel: int
) -> list[tuple[Hashable, list[object]]]:
    """Group ``(key, param)`` pairs into buckets of at most ``bucket_numel`` elements.

    ``items`` should come in the order gradients become ready (reverse of the forward order).
    A bucket holds one key only (a key is an optimizer param group and dtype); a parameter larger
    than ``bucket_numel`` gets a bucket of its own. Buckets are returned in the order they are
    expected to complete (the position of their last parameter), which is the order their
    reductions are launched in.
    """
    open_buckets: dict[Hashable, tuple[list[object], int]] = {}
    closed: list[tuple[int, Hashable, list[object]]] = []
    last_position: dict[int, int] = {}
    for position, (key, param) in enumerate(items):
        last_position[id(param)] = position
        numel = param.numel()
        if key in open_buckets and open_buckets[key][1] + numel > bucket_numel:
            closed.append((key, open_buckets.pop(key)[0]))
        members, size = open_buckets.get(key, ([], 0))
        members.append(param)
        open_buckets[key] = (members, size + numel)
    closed += [(key, members) for key, (members, _) in open_buckets.items()]
    closed.sort(key=lambda bucket: last_position[id(bucket[1][-1])])
    return closed
