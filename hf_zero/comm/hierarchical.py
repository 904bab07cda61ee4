"""Reduce-scatter and all-gather in two hops for gloo groups that span nodes.

A data-parallel group of ``k`` nodes x ``L`` ranks holds its shards in group order: shard
``n * L + i`` belongs to local rank ``i`` of node ``n``. The flat exchange (`hf_zero.comm.exchange`)
sends each peer its chunk directly, so every rank sends ``(k-1) L`` of its ``N - 1`` chunks out
of its node: ``(N - L) M`` bytes cross the network per collective, twice what a ring sends
(1.5 M at 2 x 2) and ``L`` times the minimum. The two-hop form sends each byte across once:

* all-gather: (1) exchange the shard with the ranks at the same position on the other nodes
  (the *inter* group), (2) inside the node, exchange the ``k`` shards now held; the output
  fills in place, one block of ``L`` shards per node.
* reduce-scatter: (1) inside the node, reduce-scatter each node block ``[L, S]``: local rank
  ``i`` gets the node's sum of shard ``(n, i)`` for every ``n``; (2) reduce-scatter those ``k``
  partial sums across the inter group.

Bytes out of the node: ``(k-1)/k x M/L`` per rank, ``(k-1) M`` in total, against the flat
exchange's ``(N-L) M`` (2 x 2: 1 M against 2 M). The sums run in a fixed order (local ranks,
then nodes), so results are deterministic; they differ from the flat order in the last bits.
"""

from __future__ import annotations

import torch

from hf_zero.comm import exchange
from hf_zero.comm.topology import Group


class TwoHops:
    """The started exchanges of the first hop and a function that starts the second's, run
    once the first is done; ``wait()`` finishes both."""

    def __init__(self, first: list[exchange.Exchange], second) -> None:
        self.first, self.second = first, second

    def wait(self) -> None:
        for hop in self.first:
            hop.wait()
        for hop in self.second():
            hop.wait()


def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    intra: Group,
    inter: Group,
    tags: tuple,
    held: torch.Tensor,
) -> TwoHops:
    """Start concatenating every rank's ``input`` into ``output`` (group order, as the flat
    all-gather). ``tags``: ``(inter tag, [intra tag per node])``; ``held`` receives the first
    hop (``nodes x input.numel()`` elements, allocated by the caller's thread)."""
    size = input.numel()
    block = intra.size * size
    first = [exchange.all_gather(held, input, inter, tags[0])]

    def second() -> list[exchange.Exchange]:
        return [
            exchange.all_gather(
                output[n * block : (n + 1) * block], held[n * size : (n + 1) * size], intra, tag
            )
            for n, tag in enumerate(tags[1])
        ]

    return TwoHops(first, second)


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    intra: Group,
    inter: Group,
    tags: tuple,
    buffers: tuple,
) -> TwoHops:
    """Start summing ``input`` across every rank; this rank's shard lands in ``output``.
    ``tags``: ``([intra tag per node], inter tag)``; ``buffers`` from `receive_buffers`."""
    size = output.numel()
    block = intra.size * size
    partial, intra_buffers, inter_buffers = buffers
    first = [
        exchange.reduce_scatter(
            partial[n * size : (n + 1) * size],
            input[n * block : (n + 1) * block],
            intra,
            tag,
            intra_buffers[n],
        )
        for n, tag in enumerate(tags[0])
    ]

    def second() -> list[exchange.Exchange]:
        return [exchange.reduce_scatter(output, partial, inter, tags[1], inter_buffers)]

    return TwoHops(first, second)


def receive_buffers(output: torch.Tensor, intra: Group, inter: Group) -> tuple:
    """Everything `reduce_scatter` receives into, allocated on the caller's thread (see
    `hf_zero.comm.exchange.receive_buffers`)."""
    nodes = inter.size
    partial = output.new_empty(nodes * output.numel())
    per_node = [exchange.receive_buffers(output, intra) for _ in range(nodes)]
    return partial, per_node, exchange.receive_buffers(output, inter)


def wire_bytes(nbytes: int, intra: Group, inter: Group) -> tuple[int, int]:
    """``(sent, sent to other nodes)`` by one rank for an ``nbytes`` collective (the input of a
    reduce-scatter, the output of an all-gather: both hops send the same)."""
    nodes, local = inter.size, intra.size
    shard = nbytes // (nodes * local)
    off_node = (nodes - 1) * shard
    return off_node + nodes * (local - 1) * shard, off_node
