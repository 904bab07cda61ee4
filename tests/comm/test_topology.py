"""Process groups: tensor-parallel runs of consecutive ranks, data-parallel across them, nodes."""

import pytest
import torch
import torch.distributed as dist

from hf_zero.comm.topology import Topology
from hf_zero.testing import run_distributed


def _groups(tp_size: int, node_size: int | None) -> dict:
    topo = Topology.build(tp_size=tp_size, node_size=node_size)
    # Each group really works: the sum of ranks over it.
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total, group=topo.dp.pg)
    return {
        "dp": topo.dp.ranks,
        "tp": topo.tp.ranks,
        "intra": topo.intra_node.ranks,
        "inter": topo.inter_node.ranks,
        "dp_spans": topo.dp.spans_nodes,
        "tp_spans": topo.tp.spans_nodes,
        "dp_sum": total.item(),
    }


@pytest.mark.slow
def test_four_ranks_tp2_two_nodes():
    results = run_distributed(_groups, 4, args=(2, 2))
    assert [r["tp"] for r in results] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [r["dp"] for r in results] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert [r["intra"] for r in results] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [r["inter"] for r in results] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert all(r["dp_spans"] and not r["tp_spans"] for r in results)
    assert [r["dp_sum"] for r in results] == [2.0, 4.0, 2.0, 4.0]


def test_two_ranks_defaults_to_one_node_from_local_world_size():
    for r in run_distributed(_groups, 2, args=(1, None)):
        assert r["dp"] == (0, 1) and r["intra"] == (0, 1) and not r["dp_spans"]


def _bad_tp() -> None:
    Topology.build(tp_size=3)


def test_tp_size_must_divide_world():
    with pytest.raises(AssertionError, match="'tp_size' = 3 must divide the world size 2"):
        run_distributed(_bad_tp, 2)


def _pipeline_groups(pp_size: int, tp_size: int) -> dict:
    topo = Topology.build(tp_size, pp_size=pp_size)
    return {
        "pp": topo.pp.ranks if topo.pp is not None else None,
        "tied": topo.tied.ranks if topo.tied is not None else None,
        "dp": topo.dp.ranks,
        "tp": topo.tp.ranks,
        "position": (topo.pp_rank, topo.dp_rank, topo.tp_rank),
        "back": topo.rank_of(topo.pp_rank, topo.dp_rank, topo.tp_rank),
        "dp_hierarchy": topo.dp.hierarchy,
    }


@pytest.mark.slow
def test_pipeline_stages_are_outermost_and_tensor_parallel_innermost():
    """``rank = (pp * dp_size + dp) * tp_size + tp``, the layout Megatron and DeepSpeed use."""
    two_stages = run_distributed(_pipeline_groups, 4, args=(2, 1))  # 2 stages x 2 replicas
    assert [r["pp"] for r in two_stages] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert [r["tied"] for r in two_stages] == [r["pp"] for r in two_stages]
    assert [r["dp"] for r in two_stages] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [r["position"] for r in two_stages] == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]
    assert [r["back"] for r in two_stages] == [0, 1, 2, 3]
    assert all(r["dp_hierarchy"] is None for r in two_stages)
    with_tp = run_distributed(_pipeline_groups, 4, args=(2, 2))  # 2 stages x TP 2
    assert [r["tp"] for r in with_tp] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [r["pp"] for r in with_tp] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert [r["dp"] for r in with_tp] == [(0,), (1,), (2,), (3,)]
    assert [r["position"] for r in with_tp] == [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1)]


def test_without_a_pipeline_there_are_no_pipeline_groups():
    for r in run_distributed(_pipeline_groups, 2, args=(1, 1)):
        assert r["pp"] is None and r["tied"] is None and r["position"][0] == 0
