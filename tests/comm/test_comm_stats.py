"""comm_stats: the collectives each stage runs and the bytes its algorithm implies.

Convention (hf_zero.comm.collectives): reduce-scatter and all-gather count the full buffer
(M bytes), all-reduce counts 2M. Per optimizer step of an fp32 model with padded size Pp and
gradient accumulation g:
  stage 0: all-reduce 2 * 4Pp at the boundary;
  stage 1: reduce-scatter 4Pp at the boundary, all-gather 4Pp;
  stage 2: reduce-scatter 4Pp every micro-batch (g times), all-gather 4Pp.
Control traffic is booked apart (purpose "control"): the clipped global norm (one fp32 scalar per
step, stages 1-2) and one byte per bucket per synced backward (which buckets any rank received).
Wire bytes per algorithm: tests/comm/test_comm_wire.py.
"""

import pytest
import torch
import torch.distributed as dist
from helpers import BUCKET, batch, build_model, two_param_groups

import hf_zero
from hf_zero.testing import run_distributed

STEPS = 2


def _comm(stage: int, gas: int, clip: float) -> dict:
    model = build_model()
    engine = hf_zero.initialize(
        model,
        torch.optim.AdamW(two_param_groups(model)),
        stage=stage,
        gradient_accumulation_steps=gas,
        gradient_clipping=clip,
        reduce_bucket_size=BUCKET,
    )
    for step in range(STEPS):
        for micro in range(gas):
            x = batch(dist.get_rank(), step, micro)
            engine.backward(engine(input_ids=x, labels=x).loss)
            engine.step()
    return {
        "stats": engine.comm_stats.as_dict(),
        "control": engine.comm_stats.as_dict("control"),
        "padded": sum(g.layout.padded_numel for g in engine.groups),
        "groups": len(engine.groups),
    }


@pytest.mark.parametrize("gas", [1, 4])
def test_stage2_reduces_with_reduce_scatter_every_micro_batch(gas):
    for r in run_distributed(_comm, 2, args=(2, gas, 0.0)):
        stats, fp32_buffer = r["stats"], 4 * r["padded"]
        assert "all_reduce" not in stats, "stage 2 gradients must not be all-reduced"
        assert stats["reduce_scatter"]["bytes"] == STEPS * gas * fp32_buffer
        assert stats["reduce_scatter"]["calls"] == STEPS * gas * r["groups"]
        assert stats["all_gather"]["bytes"] == STEPS * fp32_buffer


def _all_stages() -> dict:
    return {stage: _comm(stage, 4, 1.0) for stage in (0, 1, 2)}


def test_stage0_and_1_communicate_at_the_boundary_only():
    for r in run_distributed(_all_stages, 2):
        norm_all_reduce = STEPS * 2 * 4  # one fp32 scalar per step for the clipped global norm
        s0, s1, s2 = r[0]["stats"], r[1]["stats"], r[2]["stats"]
        c0, c1, c2 = r[0]["control"], r[1]["control"], r[2]["control"]
        # Padding depends on the shard count (stage 0 does not shard), so each stage's own size.
        b0, b1, b2 = (4 * r[stage]["padded"] for stage in (0, 1, 2))
        flags = [2 * r[stage]["groups"] for stage in (0, 1, 2)]  # per synced backward
        assert s0["all_reduce"]["bytes"] == STEPS * 2 * b0
        assert "reduce_scatter" not in s0 and "all_gather" not in s0
        assert c0["all_reduce"]["bytes"] == STEPS * flags[0]  # stage 0 norm is local
        assert s1["reduce_scatter"]["bytes"] == STEPS * b1
        assert s1["all_gather"]["bytes"] == STEPS * b1
        assert "all_reduce" not in s1 and "all_reduce" not in s2
        assert c1["all_reduce"]["bytes"] == norm_all_reduce + STEPS * flags[1]
        assert s2["reduce_scatter"]["bytes"] == STEPS * 4 * b2
        assert c2["all_reduce"]["bytes"] == norm_all_reduce + STEPS * 4 * flags[2]


def _node_split() -> dict:
    return _comm(2, 1, 0.0)["stats"]


def test_bytes_are_booked_inter_node_when_the_group_spans_nodes():
    same_node = run_distributed(_node_split, 2)[0]
    two_nodes = run_distributed(_node_split, 2, node_size=1)[0]
    for kind in ("reduce_scatter", "all_gather"):
        assert same_node[kind]["inter_node_bytes"] == 0
        assert same_node[kind]["intra_node_bytes"] == same_node[kind]["bytes"] > 0
        assert two_nodes[kind]["intra_node_bytes"] == 0
        assert two_nodes[kind]["inter_node_bytes"] == same_node[kind]["bytes"]


def _gloo_paths() -> dict:
    from hf_zero.comm import Collectives
    from hf_zero.comm.topology import Topology

    topo = Topology.build()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    full = torch.randn(world * 1000)
    common = torch.randn(1000)  # the same all-gather input for both paths
    out = {}
    paths = {"exchange": Collectives(), "native": Collectives(native_collectives=True)}
    for name, comm in paths.items():
        shard = torch.empty(1000)
        given = full.clone()
        comm.reduce_scatter(shard, given, topo.dp, async_op=True).wait()
        gathered = torch.empty(world * 1000)
        comm.all_gather(gathered, common, topo.dp)
        # Booked alike by the paper's convention (wire bytes differ: gloo's own reduce-scatter
        # is an all-reduce; see test_comm_wire.py).
        paper = {k: (v["calls"], v["paper_bytes"]) for k, v in comm.stats.as_dict().items()}
        out[name] = (shard, gathered, paper, torch.equal(given, full))
    (s1, g1, b1, kept1), (s2, g2, b2, kept2) = out["exchange"], out["native"]
    return {
        "shard": (s1 - s2).abs().max().item(),
        "shard_identical": torch.equal(s1, s2),
        "gather": torch.equal(g1, g2),
        "bytes": b1 == b2,
        "input_kept": kept1 and kept2,
    }


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_gloo_exchange_reduce_scatter_and_all_gather_match_the_native_ones(world_size):
    for r in run_distributed(_gloo_paths, world_size):
        assert r["shard"] <= 1e-5 and r["gather"] and r["bytes"] and r["input_kept"], r
        if world_size == 2:  # one addition per element: the same bits whatever the algorithm
            assert r["shard_identical"], r
