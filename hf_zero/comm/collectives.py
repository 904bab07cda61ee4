"""Thin wrappers over ``torch.distributed`` collectives that count the bytes they move.

Byte convention (the ZeRO paper's "data volume"): a reduce-scatter of an ``M``-byte buffer and an
all-gather into an ``M``-byte buffer each count ``M``; an all-reduce counts ``2M`` (it is a
reduce-scatter plus an all-gather); a broadcast counts ``M``; an all-to-all counts its input. Each
call is booked as ``inter_node`` when its group spans more than one node, else ``intra_node``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hf_zero.topology import Group

# torch 2.13 renamed the tensor-in/tensor-out collectives; keep working on torch >= 2.6.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CommStats:
    """Bytes and calls per collective kind, split by intra-node and inter-node."""

    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    intra_node_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    inter_node_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def record(self, kind: str, nbytes: int, spans_nodes: bool) -> None:
        self.calls[kind] += 1
        (self.inter_node_bytes if spans_nodes else self.intra_node_bytes)[kind] += nbytes

    def bytes(self, kind: str | None = None) -> int:
        """Total bytes of one kind (or of all kinds), intra- plus inter-node."""
        kinds = [kind] if kind else set(self.intra_node_bytes) | set(self.inter_node_bytes)
        return sum(self.intra_node_bytes.get(k, 0) + self.inter_node_bytes.get(k, 0) for k in kinds)

    def reset(self) -> None:
        self.calls.clear()
        self.intra_node_bytes.clear()
        self.inter_node_bytes.clear()

    def as_dict(self) -> dict[str, dict[str, int]]:
        kinds = sorted(set(self.calls))
        return {
            k: {
                "calls": self.calls[k],
                "bytes": self.bytes(k),
                "intra_node_bytes": self.intra_node_bytes.get(k, 0),
                "inter_node_bytes": self.inter_node_bytes.get(k, 0),
            }
            for k in kinds
        }

    def __repr__(self) -> str:
        rows = [f"{k}: {v['calls']} calls, {v['bytes']} B" for k, v in self.as_dict().items()]
        return "CommStats(" + "; ".join(rows) + ")"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _SliceAfter:
    """A work handle that copies a slice of an all-reduced buffer out once it has finished."""

    def __init__(self, work, output: torch.Tensor, reduced: torch.Tensor) -> None:
        self.work, self.output, self.reduced = work, output, reduced

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
        self.output.copy_(self.reduced)


class Collectives:
    """The collectives the engine uses, each booked into ``stats``.

    ``async_op=True`` returns the work handle (``None`` for a single-rank group, where the
    collective is a local copy and nothing is booked).

    On gloo (CPU) groups, floating-point reduce-scatter and all-gather run as an in-place
    all-reduce: gloo's ring all-reduce of a buffer is 2.2x faster than its reduce-scatter and
    1.5x faster than its all-gather of the same buffer (440 MB, 2 ranks, measured), so this is
    faster even though it moves more data. Results are the same sums (the all-gather exactly);
    the reduce-scatter's input buffer is overwritten with the full sum (callers own it);
    bytes are booked as the collective asked for, by the ZeRO paper's convention. Only buffers
    of at least ``emulate_min_bytes`` take this path: at 4 ranks and 1 MB gloo's own all-gather
    is the faster one (0.004 s vs 0.006 s). ``emulate_on_gloo=False`` keeps the native
    collectives everywhere.
    """

    def __init__(
        self,
        stats: CommStats | None = None,
        emulate_on_gloo: bool = True,
        emulate_min_bytes: int = 8 << 20,
    ) -> None:
        self.stats = stats if stats is not None else CommStats()
        self.emulate_on_gloo = emulate_on_gloo
        self.emulate_min_bytes = emulate_min_bytes

    def _via_all_reduce(self, group: Group, tensor: torch.Tensor) -> bool:
        return (
            self.emulate_on_gloo
            and tensor.is_floating_point()
            and _nbytes(tensor) >= self.emulate_min_bytes
            and dist.get_backend(group.pg) == "gloo"
        )

    def all_reduce(self, tensor: torch.Tensor, group: Group, async_op: bool = False):
        if group.size == 1:
            return None
        self.stats.record("all_reduce", 2 * _nbytes(tensor), group.spans_nodes)
        return dist.all_reduce(tensor, group=group.pg, async_op=async_op)

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, group: Group, async_op: bool = False
    ):
        """Sum ``input`` across the group; this rank receives its ``1/size`` slice in ``output``."""
        if group.size == 1:
            output.copy_(input)
            return None
        self.stats.record("reduce_scatter", _nbytes(input), group.spans_nodes)
        if self._via_all_reduce(group, input):
            # In place: callers hand over the full buffer and read only `output` afterwards.
            work = dist.all_reduce(input, group=group.pg, async_op=async_op)
            index = group.rank_of(dist.get_rank())
            mine = input[index * output.numel() : (index + 1) * output.numel()]
            handle = _SliceAfter(work, output, mine)
            if not async_op:
                handle.wait()
                return None
            return handle
        return reduce_scatter_single(output, input, group=group.pg, async_op=async_op)

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, group: Group, async_op: bool = False
    ):
        """Concatenate every rank's ``input`` into ``output`` (rank order)."""
        if group.size == 1:
            output.copy_(input)
            return None
        self.stats.record("all_gather", _nbytes(output), group.spans_nodes)
        if self._via_all_reduce(group, output):
            index = group.rank_of(dist.get_rank())
            output.zero_()
            output[index * input.numel() : (index + 1) * input.numel()].copy_(input)
            return dist.all_reduce(output, group=group.pg, async_op=async_op)
        return all_gather_single(output, input, group=group.pg, async_op=async_op)

    def all_to_all(
        self, output: torch.Tensor, input: torch.Tensor, group: Group, async_op: bool = False
    ):
        """Row block ``i`` of ``input`` (split evenly along dim 0) goes to group rank ``i``."""
        if group.size == 1:
            output.copy_(input)
            return None
        self.stats.record("all_to_all", _nbytes(input), group.spans_nodes)
        return dist.all_to_all_single(output, input, group=group.pg, async_op=async_op)

    def broadcast(self, tensor: torch.Tensor, src: int, group: Group) -> None:
        """Broadcast from global rank ``src``."""
        if group.size == 1:
            return
        self.stats.record("broadcast", _nbytes(tensor), group.spans_nodes)
        dist.broadcast(tensor, src=src, group=group.pg)

    def all_reduce_max(self, tensor: torch.Tensor, group: Group) -> None:
        """Small control-plane reduction (overflow flags); booked like any all-reduce."""
        if group.size == 1:
            return
        self.stats.record("all_reduce", 2 * _nbytes(tensor), group.spans_nodes)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group.pg)
