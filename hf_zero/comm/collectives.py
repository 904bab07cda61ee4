"""Thin wrappers over ``torch.distributed`` collectives that count the bytes they move.

Every collective hf_zero issues goes through a `Collectives` (TP and control traffic included,
through `Collectives.for_purpose`). Each call is booked in `CommStats` (`hf_zero.comm.stats`)
with the ZeRO paper's data volume and the bytes this rank sends with the algorithm actually run,
as ``inter_node`` when its group spans more than one node, else ``intra_node``.
"""

from __future__ import annotations

import copy
from datetime import timedelta

import torch
import torch.distributed as dist

from hf_zero.comm import exchange, hierarchical
from hf_zero.comm.stats import ALGORITHMS, CommStats, tree_child_vranks, wire_bytes
from hf_zero.comm.topology import Group
from hf_zero.observe import clock

# torch 2.13 renamed the tensor-in/tensor-out collectives; keep working on torch >= 2.6.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Collectives:
    """The collectives the engine uses, each booked into ``stats``.

    ``async_op=True`` returns the work handle (``None`` for a single-rank group, where the
    collective is a local copy and nothing is booked).

    On gloo (CPU) groups, reduce-scatter and all-gather run as direct point-to-point exchanges
    (`hf_zero.comm.exchange`): the same bytes as a ring, and on gloo 1.5-3x faster than gloo's own
    reduce-scatter / all-gather, or an all-reduce in their place.
    No collective here writes into its input. ``native_collectives=True`` (config
    ``native_collectives: true``) calls the backend's own collectives everywhere; NCCL groups
    always do.
    """

    purpose = "zero"
    """What `CommStats` books this object's calls as; see `for_purpose`."""

    def __init__(self, stats: CommStats | None = None, native_collectives: bool = False) -> None:
        self.stats = stats if stats is not None else CommStats()
        self.native_collectives = native_collectives
        self._tags: dict[object, int] = {}
        self._background = exchange.Background()  # shared with `for_purpose` copies
        self.reductions = exchange.Background()
        """A second worker for multi-step reductions (qgZ's inter-node step), so that waiting
        on one never holds up the exchanges (prefetched gathers) queued on the first."""

    def _exchange_tag(self, group: Group) -> int | None:
        """A fresh point-to-point tag for ``group`` when the exchange path applies, else None.

        Every member calls the group's collectives in the same order, so per-group counters
        agree across ranks and concurrent exchanges (buckets in flight) never match each
        other's messages.
        """
        if self.native_collectives or dist.get_backend(group.pg) != "gloo":
            return None
        tag = self._tags.get(group.pg, 0)
        self._tags[group.pg] = (tag + 1) % (1 << 24)
        return tag

    def _exchange(self, start, async_op: bool, group: Group):
        """Run an exchange now, or (``async_op``) on the background thread; its handle."""
        if async_op:
            return clock.collective(lambda: self._background.submit(start), group.spans_nodes, True)
        clock.collective(lambda: start().wait(), group.spans_nodes, False)
        return None

    def all_reduce(self, tensor: torch.Tensor, group: Group, async_op: bool = False):
        if group.size == 1:
            return None
        self._book("all_reduce", _nbytes(tensor), group)
        return clock.collective(
            lambda: dist.all_reduce(tensor, group=group.pg, async_op=async_op),
            group.spans_nodes, async_op,
        )  # fmt: skip

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, group: Group, async_op: bool = False
    ):
        """Sum ``input`` across the group; this rank receives its ``1/size`` slice in ``output``.
        ``input`` is not written."""
        if group.size == 1:
            output.copy_(input)
            return None
        tag = self._exchange_tag(group)
        if tag is not None and group.hierarchy is not None:
            intra, inter = group.hierarchy
            tags = (
                [self._exchange_tag(intra) for _ in range(inter.size)],
                self._exchange_tag(inter),
            )
            buffers = hierarchical.receive_buffers(output, intra, inter)
            self._book_hierarchical("reduce_scatter", _nbytes(input), group)
            return self._exchange(
                lambda: hierarchical.reduce_scatter(output, input, intra, inter, tags, buffers),
                async_op, group,
            )  # fmt: skip
        self._book("reduce_scatter", _nbytes(input), group, exchanged=tag is not None)
        if tag is None:
            return clock.collective(
                lambda: reduce_scatter_single(output, input, group=group.pg, async_op=async_op),
                group.spans_nodes, async_op,
            )  # fmt: skip
        buffers = exchange.receive_buffers(output, group)
        return self._exchange(
            lambda: exchange.reduce_scatter(output, input, group, tag, buffers), async_op, group
        )

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, group: Group, async_op: bool = False
    ):
        """Concatenate every rank's ``input`` into ``output`` (rank order)."""
        if group.size == 1:
            output.copy_(input)
            return None
        tag = self._exchange_tag(group)
        if tag is not None and group.hierarchy is not None:
            intra, inter = group.hierarchy
            tags = (
                self._exchange_tag(inter),
                [self._exchange_tag(intra) for _ in range(inter.size)],
            )
            self._book_hierarchical("all_gather", _nbytes(output), group)
            held = input.new_empty(inter.size * input.numel())
            return self._exchange(
                lambda: hierarchical.all_gather(output, input, intra, inter, tags, held),
                async_op, group,
            )  # fmt: skip
        if tag is None:
            return self.all_gather_native(output, input, group, async_op)
        self._book("all_gather", _nbytes(output), group, exchanged=True)
        return self._exchange(
            lambda: exchange.all_gather(output, input, group, tag), async_op, group
        )

    def all_gather_native(
        self, output: torch.Tensor, input: torch.Tensor, group: Group, async_op: bool = False
    ):
        """`all_gather` on the backend's own collective, never queued behind the exchange
        worker: for small control messages that run while gathers are in flight."""
        if group.size == 1:
            output.copy_(input)
            return None
        self._book("all_gather", _nbytes(output), group)
        return clock.collective(
            lambda: all_gather_single(output, input, group=group.pg, async_op=async_op),
            group.spans_nodes, async_op,
        )  # fmt: skip

    def all_to_all(
        self, output: torch.Tensor, input: torch.Tensor, group: Group, async_op: bool = False
    ):
        """Row block ``i`` of ``input`` (split evenly along dim 0) goes to group rank ``i``."""
        if group.size == 1:
            output.copy_(input)
            return None
        self._book("all_to_all", _nbytes(input), group)
        return clock.collective(
            lambda: dist.all_to_all_single(output, input, group=group.pg, async_op=async_op),
            group.spans_nodes, async_op,
        )  # fmt: skip

    def broadcast(self, tensor: torch.Tensor, src: int, group: Group) -> None:
        """Broadcast from global rank ``src``."""
        if group.size == 1:
            return
        self._book("broadcast", _nbytes(tensor), group, src=src)
        clock.collective(
            lambda: dist.broadcast(tensor, src=src, group=group.pg), group.spans_nodes, False
        )

    def all_reduce_max(self, tensor: torch.Tensor, group: Group) -> None:
        """Small control-plane reduction (overflow flags); booked like any all-reduce."""
        if group.size == 1:
            return
        self._book("all_reduce", _nbytes(tensor), group)
        clock.collective(
            lambda: dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group.pg),
            group.spans_nodes, False,
        )  # fmt: skip

    def barrier(self, group: Group, monitored_timeout: timedelta | None = None) -> None:
        """Wait for every rank of ``group`` (booked as a 0-byte ``barrier`` call).

        ``monitored_timeout``: gloo's monitored barrier, which names the ranks that did not come.
        """
        if group.size == 1:
            return
        self._book("barrier", 0, group)
        if monitored_timeout is None:
            clock.collective(lambda: dist.barrier(group=group.pg), group.spans_nodes, False)
        else:
            clock.collective(
                lambda: dist.monitored_barrier(
                    group.pg, timeout=monitored_timeout, wait_all_ranks=True
                ),
                group.spans_nodes, False,
            )  # fmt: skip

    def book_send(self, tensor: torch.Tensor, peer: int, group: Group) -> None:
        """Book one point-to-point send of ``tensor`` to global rank ``peer`` of ``group``,
        issued by someone else (torch's pipeline schedules)."""
        nbytes = _nbytes(tensor)
        remote = group.off_node(dist.get_rank(), peer)
        self.stats.record(
            "send", nbytes, remote, 2, self.purpose, "point_to_point", nbytes,
            nbytes if remote else 0,
        )  # fmt: skip

    # --- accounting ---------------------------------------------------------------------------
    def for_purpose(self, purpose: str) -> Collectives:
        """The same collectives (same stats, settings and exchange tags), booked as ``purpose``:
        ``"zero"``, ``"tp"`` or ``"control"`` (see `hf_zero.comm.stats`)."""
        twin = copy.copy(self)  # shallow: shares stats and the per-group tag counters
        twin.purpose = purpose
        return twin

    def _book(
        self, kind: str, nbytes: int, group: Group, exchanged: bool = False, src: int | None = None
    ) -> None:
        """Record one call with the algorithm that will run (see the table in ``stats``)."""
        clock.mark(f"{kind} ({self.purpose})")
        gloo = dist.get_backend(group.pg) == "gloo"
        algorithm = ALGORITHMS[kind][gloo] if not exchanged else "exchange"
        me = dist.get_rank()
        here = group.rank_of(me)
        if algorithm == "binomial_tree":
            vrank = (here - group.rank_of(src)) % group.size
            wire = wire_bytes(algorithm, nbytes, group.size, vrank)
            root = group.rank_of(src)
            children = tree_child_vranks(vrank, group.size)
            peers = [group.ranks[(root + c) % group.size] for c in children]
        else:
            wire = wire_bytes(algorithm, nbytes, group.size)
            peers = list(group.ranks[:here] + group.ranks[here + 1 :])
            if algorithm in ("ring", "ring_all_reduce", "gloo_all_reduce", "chain"):
                peers = [group.ranks[(here + 1) % group.size]]  # a ring sends to its successor
        remote = sum(group.off_node(me, p) for p in peers)
        off_node = wire * remote // len(peers) if peers else 0
        self.stats.record(
            kind, nbytes, group.spans_nodes, group.size, self.purpose, algorithm, wire, off_node
        )

    def _book_hierarchical(self, kind: str, nbytes: int, group: Group) -> None:
        clock.mark(f"{kind} ({self.purpose})")
        intra, inter = group.hierarchy
        wire, off_node = hierarchical.wire_bytes(nbytes, intra, inter)
        self.stats.record(
            kind, nbytes, True, group.size, self.purpose, "hierarchical", wire, off_node
        )
