"""Two-hop reduce-scatter / all-gather on data-parallel groups that span nodes.

Simulated nodes (``node_size``) on one machine: the results equal the flat exchange's (exactly,
on integer-valued data); comm_stats books each rank's bytes to other nodes as the two-hop
formula says, ``(k-1)/k`` of ``M/L`` against the flat exchange's ``(k-1)L/(N-1)`` of
``(N-1)/N M``, and the flat algorithms' bytes are split by destination too.
"""

import pytest
import torch
import torch.distributed as dist

from hf_zero.comm import Collectives
from hf_zero.comm.topology import Topology
from hf_zero.testing import run_distributed


def _two_hops(tp_size: int, node_size: int, numel: int) -> dict:
    topo = Topology.build(tp_size=tp_size, node_size=node_size)
    group = topo.dp
    n, me = group.size, group.rank_of(dist.get_rank())
    hier, flat = Collectives(), Collectives()
    plain = type(group)(group.pg, group.ranks, group.spans_nodes, group.node_size)
    torch.manual_seed(dist.get_rank())
    x = torch.randint(-50, 50, (numel * n,)).float()
    out = {}
    for name, comm, g in (("hier", hier, group), ("flat", flat, plain)):
        shard, full = torch.empty(numel), torch.empty(numel * n)
        comm.reduce_scatter(shard, x, g, async_op=True).wait()
        comm.all_gather(full, shard, g)
        out[name] = (shard, full)
    everyone = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, x)
    total = sum(everyone[r] for r in group.ranks)
    return {
        "has_hierarchy": group.hierarchy is not None,
        "equal": torch.equal(out["hier"][0], out["flat"][0])
        and torch.equal(out["hier"][1], out["flat"][1]),
        "right": torch.equal(out["hier"][1], total),
        "mine": torch.equal(out["hier"][0], total[me * numel : (me + 1) * numel]),
        "hier": hier.stats.as_dict(),
        "flat": flat.stats.as_dict(),
        "n": n,
    }


@pytest.mark.slow
def test_two_hops_equal_the_flat_exchange_and_book_bytes_by_destination():
    numel = 1000
    for r in run_distributed(_two_hops, 4, args=(1, 2, numel), node_size=2):
        assert r["has_hierarchy"] and r["equal"] and r["right"] and r["mine"]
        m = 4 * numel * r["n"]  # fp32 bytes of the full buffer; 2 nodes x 2 ranks
        for kind in ("reduce_scatter", "all_gather"):
            hier, flat = r["hier"][kind], r["flat"][kind]
            assert hier["algorithms"] == {"hierarchical": 1} and flat["algorithms"] == {
                "exchange": 1
            }
            # two hops: (k-1) shards of M/N out of the node, k (L-1) shards inside it
            assert hier["inter_node_wire_bytes"] == m // 4
            assert hier["intra_node_wire_bytes"] == 2 * m // 4
            # flat exchange: 3 chunks of M/4, to 2 remote peers and 1 local one
            assert flat["inter_node_wire_bytes"] == 2 * m // 4
            assert flat["intra_node_wire_bytes"] == m // 4
            assert hier["paper_bytes"] == flat["paper_bytes"] == m


def _ring_split() -> dict:
    topo = Topology.build(node_size=2)
    comm = Collectives()
    comm.all_reduce(torch.ones(1000), topo.dp)
    comm.broadcast(torch.ones(1000), 0, topo.dp)
    return {"rank": dist.get_rank(), **comm.stats.as_dict()}


@pytest.mark.slow
def test_ring_and_tree_bytes_split_by_the_next_hop():
    for r in run_distributed(_ring_split, 4, node_size=2):
        ring = r["all_reduce"]
        # ring 0 -> 1 -> 2 -> 3 -> 0: ranks 1 and 3 send their 2 (N-1)/N M to another node
        remote = r["rank"] in (1, 3)
        assert ring["inter_node_wire_bytes"] == (6000 if remote else 0)
        assert ring["wire_bytes"] == 6000
        tree = r["broadcast"]  # root 0 sends to 1 (local) and 2 (remote), 1 to 3 (remote)
        expected = {0: (8000, 4000), 1: (4000, 4000), 2: (0, 0), 3: (0, 0)}[r["rank"]]
        assert (tree["wire_bytes"], tree["inter_node_wire_bytes"]) == expected
