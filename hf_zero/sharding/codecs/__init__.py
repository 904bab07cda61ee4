"""Codecs: how a `FlatParamGroup` is gathered and how its gradients are reduced.

A group holds one gather codec and one reduce codec, picked once from the configuration by
`gather_codec` and `reduce_codec`; the group itself only says when. Each codec owns the state of
its collective in flight.

=========================  ======================================================================
gather codec               what a gather sends
=========================  ======================================================================
`NoGather`                 nothing: stages 0-2 hold the full parameters all the time
`ExactGather`              the 16-bit shards (a MixZ++ tier: its INT8 rows, all it has)
`QwZGather`                the shards quantized to INT8 blocks + scales (ZeRO++ qwZ)
`HpZGather` (wraps one)    from the secondary shard kept after the first gather (ZeRO++ hpZ)
=========================  ======================================================================

=========================  ======================================================================
reduce codec               how a bucket's gradients are summed
=========================  ======================================================================
`NoReduce`                 nothing: a frozen group has no gradients
`AllReduce`                all-reduce of the whole buffer (stage 0)
`ReduceScatter`            reduce-scatter, each rank keeps its shard (stages 1-3)
`QgZReduce`                quantized all-to-all, intra- then inter-node (ZeRO++ qgZ, stages 2-3)
=========================  ======================================================================

Adding a codec is one class here (or one module) and one line in the chooser below.
"""

from __future__ import annotations

from hf_zero.comm import Collectives, ZeroPPSettings
from hf_zero.comm.topology import Group
from hf_zero.sharding.codecs.gather import ExactGather, HpZGather, NoGather, QwZGather
from hf_zero.sharding.codecs.reduce import AllReduce, NoReduce, QgZReduce, ReduceScatter


def gather_codec(
    comm: Collectives, settings: ZeroPPSettings, group: Group, rank: int, permanent: bool
):
    """The codec a stage-3 group gathers with in training (exact gathers use `ExactGather`)."""
    quantize = settings.quantized_weights and group.size > 1 and not permanent
    codec = (QwZGather if quantize else ExactGather)(comm, group, settings)
    if settings.hpz is not None:
        codec = HpZGather(codec, settings.hpz, rank, permanent)
    return codec


def reduce_codec(
    comm: Collectives, settings: ZeroPPSettings, stage: int, group: Group, padded_numel: int
):
    """The codec a trainable group reduces its gradients with."""
    if stage == 0:
        return AllReduce(comm, group)
    if settings.quantized_gradients and stage >= 2:
        return QgZReduce(comm, settings, padded_numel)
    return ReduceScatter(comm, group)


__all__ = [
    "AllReduce",
    "ExactGather",
    "HpZGather",
    "NoGather",
    "NoReduce",
    "QgZReduce",
    "QwZGather",
    "ReduceScatter",
    "gather_codec",
    "reduce_codec",
]
