"""ZeRO++: qwZ (quantized weight gather), hpZ (secondary partition), qgZ (quantized gradient
all-to-all), on 4 ranks as 2 simulated nodes of 2 (``node_size=2``).

Tolerances, and why:

* hpZ changes no arithmetic: fp32 parity with DDP at 1e-6, as for plain ZeRO-3.
* The quantized collectives are checked against the exact collective within their error bound,
  computed from the inputs: half a quantization step (``absmax / (2 * qmax)``) per element and per
  quantization, summed over the values that meet in a reduction.
* Short runs with qwZ/qgZ: loss within 1e-3 relative of DDP (INT8 weights are within 0.4% of
  their block's absmax, which moves this model's loss by ~1e-4), parameters within 5%: Adam
  divides by the gradient's running RMS, so on elements whose gradient is near zero a quantized
  gradient changes the update by up to ``lr`` per step (3 steps x 1e-3 on weights of std 0.02).
  Each test also checks that quantization did change something, so it cannot pass vacuously.
* 200-step convergence: final loss (mean of the last 20 steps) within 2% of plain ZeRO-3 at the
  same precision and seeds, as the issue asks; measured 0.7% (bf16) and 0.1% (fp16).
"""

import pytest
import torch
import torch.distributed as dist
from helpers import (
    batch,
    build_model,
    max_loss_diff,
    max_param_diff,
    train_ddp,
    train_on_corpus,
    train_step,
    train_zero,
    zero_engine,
)

import hf_zero
from hf_zero.comm import (
    Collectives,
    QuantizedGather,
    QuantizedReduceScatter,
    ZeroPPSettings,
    quantize_shard,
)
from hf_zero.comm.topology import Topology
from hf_zero.numerics.quant import QMAX
from hf_zero.testing import run_distributed
from hf_zero.tiny import tiny_llama

NODES = dict(node_size=2)
ZERO3 = dict(param_persistence_threshold=50, **NODES)
ALL = dict(quantized_weights=True, hpz_partition_size=2, quantized_gradients=True)


# --- the collectives, within their error bound --------------------------------------------------
def _quantized_gather(bits: int, numel: int, dtype: torch.dtype) -> dict:
    rank = dist.get_rank()
    topo = Topology.build(**NODES)
    torch.manual_seed(rank)
    shard = (torch.randn(numel) * 10.0**rank).to(dtype)  # very different magnitudes per rank
    comm = Collectives()
    out = torch.empty(4 * numel, dtype=dtype)
    QuantizedGather(comm, out, quantize_shard(shard, bits, 64), topo.dp, async_op=True).wait()
    quantized_bytes = comm.stats.bytes("all_gather")
    exact = torch.empty_like(out)
    comm.all_gather(exact, shard, topo.dp)
    absmax = torch.empty(4)
    comm.all_gather(absmax, shard.float().abs().max().view(1), topo.dp)
    err = (out.float() - exact.float()).abs().view(4, numel).amax(dim=1)
    # Half a step of the largest block, plus the output dtype's rounding.
    bound = absmax / (2 * QMAX[bits]) + absmax * torch.finfo(dtype).eps
    return {
        "within": bool((err <= bound).all()),
        "changed": bool((err > 0).any()),
        "checksum": out.float().sum().item(),
        "byte_ratio": quantized_bytes / (exact.numel() * exact.element_size()),
    }


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantized_all_gather_within_bound(bits, dtype):
    numel = 1000  # not a multiple of the block size (64): the last block is padded
    results = run_distributed(_quantized_gather, 4, args=(bits, numel, dtype))
    for r in results:
        assert r["within"] and r["changed"], r
    assert len({r["checksum"] for r in results}) == 1, "ranks must see identical parameters"
    blocks = -(-numel // 64)
    # Whole blocks travel (the last one padded), plus one fp32 scale per block.
    payload = (blocks * 64 * bits // 8 + blocks * 4) / (numel * torch.finfo(dtype).bits // 8)
    assert results[0]["byte_ratio"] == pytest.approx(payload)


def _quantized_reduce(node_size: int, bits: int, shard_numel: int, repeats: int, ef: bool):
    rank = dist.get_rank()
    topo = Topology.build(node_size=node_size)
    settings = ZeroPPSettings(
        quantized_gradients=True,
        gradient_bits=bits,
        intra=topo.dp_intra_node,
        inter=topo.dp_inter_node,
        block_size=64,
        error_feedback=ef,
    )
    torch.manual_seed(rank)
    full = torch.randn(4 * shard_numel) * (1.0 + rank)
    comm = Collectives()
    reducer = QuantizedReduceScatter(comm, settings, full.numel())
    outputs = []
    for _ in range(repeats):
        reducer.launch(full.clone())
        outputs.append(reducer.finish())
    inter_bytes = sum(comm.stats.inter_node_bytes.values()) / repeats
    exact = torch.empty(shard_numel)
    comm.reduce_scatter(exact, full, topo.dp)
    absmax = torch.empty(4)
    comm.all_gather(absmax, full.abs().max().view(1), topo.dp)
    # Step 1 rounds each local rank's value once; step 2 rounds each node's partial sum once.
    half_step = 1 / (2 * QMAX[bits])
    step1 = absmax.view(-1, node_size).sum(dim=1) * half_step if node_size > 1 else 0 * absmax
    partials = absmax.view(-1, node_size).sum(dim=1) + step1
    bound = step1.max() + (partials.sum() * half_step if 4 // node_size > 1 else 0)
    errors = [(o - exact).abs().max().item() for o in outputs]
    mean_error = (torch.stack(outputs).mean(dim=0) - exact).abs().max().item()
    return {
        "errors": errors,
        "mean_error": mean_error,
        "bound": float(bound),
        "inter_bytes": inter_bytes,
        "plain_bytes": full.numel() * 2,  # a bf16 reduce-scatter of the same buffer
    }


@pytest.mark.parametrize("node_size", [1, 2, 4], ids=["4-nodes", "2-nodes", "1-node"])
@pytest.mark.parametrize("bits", [8, 4])
def test_hierarchical_quantized_reduce_within_bound(node_size, bits):
    shard_numel = 250  # chunks of 500 and 250 elements: padded to whole blocks of 64
    for r in run_distributed(_quantized_reduce, 4, args=(node_size, bits, shard_numel, 1, False)):
        assert 0 < r["errors"][0] <= r["bound"], r
        if node_size == 2:
            # Only step 2 crosses nodes: 2 rows of 250 values, each padded to 4 blocks of 64,
            # plus one fp32 scale per block.
            blocks = -(-shard_numel // 64)
            expected = 2 * blocks * (64 * bits / 8 + 4)
            assert r["inter_bytes"] == expected
            assert r["inter_bytes"] <= 0.3 * r["plain_bytes"]
        if node_size == 4:
            assert r["inter_bytes"] == 0


def test_error_feedback_cancels_rounding_over_steps():
    """Reducing the same gradient 16 times: with error feedback the residuals carry over, so the
    mean of the results approaches the exact sum; without it the same error repeats."""
    plain = run_distributed(_quantized_reduce, 4, args=(2, 4, 250, 16, False))
    fed = run_distributed(_quantized_reduce, 4, args=(2, 4, 250, 16, True))
    for p, f in zip(plain, fed):
        assert p["mean_error"] == pytest.approx(p["errors"][0])  # deterministic, no cancelling
        assert f["mean_error"] < 0.25 * p["mean_error"], (f, p)
        assert max(f["errors"]) <= 2 * f["bound"]  # each result stays near the exact one


# --- the engine ---------------------------------------------------------------------------------
def _short_run(cfg: dict, precision: str, stage: int = 3) -> dict:
    ref_losses, ref_params = train_ddp(3, 2, 0.3, precision=precision)
    losses, params, engine = train_zero(3, 2, 0.3, stage, precision=precision, **ZERO3, **cfg)
    out = {
        "loss": max_loss_diff(losses, ref_losses),
        "param": max_param_diff(params, ref_params),
        "inter_all_gather": engine.comm_stats.inter_node_bytes.get("all_gather", 0),
        "intra_all_gather": engine.comm_stats.intra_node_bytes.get("all_gather", 0),
        "sharded_bytes": sum(g.numel * g.dtype.itemsize for u in engine.units for g in u.groups),
        "persistent_bytes": sum(g.numel * g.dtype.itemsize for g in engine.groups if g.stage == 2),
        "all_to_all": engine.comm_stats.bytes("all_to_all"),
        "reduce_scatter": engine.comm_stats.bytes("reduce_scatter"),
    }
    # fp32 stage 3 steps the shards in place, so the exact gather must equal the masters.
    saved, masters = engine.full_state_dict(), engine.full_state_dict(master_weights=True)
    out["exact_save"] = all(torch.equal(saved[k], masters[k]) for k in saved)
    return out


@pytest.mark.slow
def test_hpz_is_exact_and_keeps_backward_gathers_in_the_node():
    for r in run_distributed(_short_run, 4, args=(dict(hpz_partition_size=2), "fp32")):
        assert r["loss"] <= 1e-6 and r["param"] <= 1e-6, r
        # One cross-node gather per unit per optimizer step (the first forward); every later
        # gather in the step (backward, the second micro-batch) reads the secondary shards.
        # The small persistent parameters are all-gathered once after each step, as in stage 2,
        # and the final exact gather for the comparison reads the primary shards once more.
        steps = 3 * (r["sharded_bytes"] + r["persistent_bytes"])
        assert r["inter_all_gather"] == steps + r["sharded_bytes"], r
        assert r["intra_all_gather"] > 0


@pytest.mark.slow
@pytest.mark.parametrize(
    ("stage", "cfg"),
    [
        (3, dict(quantized_weights=True)),
        (3, dict(quantized_gradients=True)),
        (2, dict(quantized_gradients=True)),
        (3, ALL),
    ],
    ids=["qwZ", "qgZ", "stage2-qgZ", "qwZ+hpZ+qgZ"],
)
def test_quantized_modes_track_ddp(stage, cfg):
    for r in run_distributed(_short_run, 4, args=(cfg, "fp32", stage)):
        assert 0 < r["loss"] <= 1e-3, r
        assert 0 < r["param"] <= 5e-2, r
        assert r["exact_save"], "full_state_dict must never be quantized"
        if cfg.get("quantized_gradients"):
            assert r["all_to_all"] > 0 and r["reduce_scatter"] == 0, r


def _hpz_memory() -> dict:
    rank = dist.get_rank()
    model = build_model()
    engine = zero_engine(model, stage=3, hpz_partition_size=2, **ZERO3)
    before = engine.memory_report()["secondary_params"]
    x = batch(rank, 0, 0)
    engine.backward(engine(input_ids=x, labels=x).loss)
    during = engine.memory_report()
    expected = sum(g.numel // 2 * 4 for g in engine.groups + engine.frozen_groups if g.stage == 3)
    engine.step()
    return {
        "before": before,
        "during": during["secondary_params"],
        "expected": expected,
        "in_total": during["total"]
        == sum(during[k] for k in ("params", "grads", "master_weights", "optimizer_states"))
        + during["secondary_params"],
        "after": engine.memory_report()["secondary_params"],
    }


def test_hpz_secondary_shards_are_reported_and_dropped_after_the_step():
    for r in run_distributed(_hpz_memory, 4):
        assert r["before"] == 0 and r["after"] == 0, r
        assert r["during"] == r["expected"] > 0 and r["in_total"], r


def _comm_per_step(precision: str, steps: int = 3) -> dict:
    out = {}
    for name, cfg in {"plain": {}, "zero++": ALL}.items():
        model = build_model()
        engine = zero_engine(model, stage=3, precision=precision, **ZERO3, **cfg)
        for step in range(steps):
            train_step(engine, model, step)
        out[name] = sum(engine.comm_stats.inter_node_bytes.values()) / steps
        out[name + "_kinds"] = dict(engine.comm_stats.inter_node_bytes)
    return out


def test_inter_node_bytes_at_most_0_3x_of_zero3():
    for r in run_distributed(_comm_per_step, 4, args=("bf16",)):
        ratio = r["zero++"] / r["plain"]
        assert ratio <= 0.3, r  # the paper's 0.25x plus scales and the 16-bit small params


def _converge(precision: str, steps: int) -> dict:
    final = {}
    for name, cfg in {"plain": {}, "zero++": ALL}.items():
        model = tiny_llama(0)
        engine = hf_zero.initialize(
            model,
            torch.optim.AdamW(model.parameters(), lr=1e-3),
            stage=3,
            precision=precision,
            # fp16: start at 2^10 so neither run skips steps; a plain fp16 reduce-scatter
            # overflows at 2^16 where qgZ (fp32 sums) does not, which would compare step counts.
            initial_scale_power=10,
            **NODES,
            **cfg,
        )
        # 2 windows of 32 tokens per rank and step: 4 ranks share this machine's cores, and the
        # 16-bit matmuls are emulated on CPUs without bf16 instructions.
        losses = train_on_corpus(engine, steps, seq_len=32, batch_size=2)
        final[name] = sum(losses[-20:]) / 20
        final[name + "_first"] = losses[0]
        final[name + "_skipped"] = engine.skipped_steps
    return final


def _converge_both(steps: int) -> dict:
    return {precision: _converge(precision, steps) for precision in ("bf16", "fp16")}


@pytest.mark.slow
def test_200_steps_converge_within_2_percent_of_zero3():
    """bf16 and fp16, in one group of 4 ranks (one start-up for both)."""
    for precision, r in run_distributed(_converge_both, 4, args=(200,))[0].items():
        assert r["plain"] < 0.5 * r["plain_first"], (precision, r)  # it did learn
        assert abs(r["zero++"] - r["plain"]) <= 0.02 * r["plain"], (precision, r)
        assert r["plain_skipped"] == r["zero++_skipped"] == 0, (precision, r)


def _overflow_with_qgz() -> dict:
    model = build_model()
    engine = zero_engine(
        model,
        stage=2,
        precision="fp16",
        initial_scale_power=10,
        quantized_gradients=True,
        quantized_gradients_error_feedback=True,
        **NODES,
    )
    stepped = [train_step(engine, model, step, poison=step == 1) for step in range(3)]
    residuals = [r for g in engine.groups for r in g._quantized_reduce.residuals.values()]
    return {
        "stepped": stepped,
        "finite": all(bool(torch.isfinite(r).all()) for r in residuals),
        "params_finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
    }


def test_fp16_overflow_under_qgz_skips_the_step_everywhere():
    for r in run_distributed(_overflow_with_qgz, 4):
        assert r["stepped"] == [True, False, True], r
        assert r["finite"] and r["params_finite"], r


def _bad_hpz() -> None:
    model = build_model()
    hf_zero.initialize(model, torch.optim.AdamW(model.parameters()), stage=3, hpz_partition_size=3)


def test_hpz_that_does_not_divide_the_world_is_refused():
    with pytest.raises(AssertionError, match="'hpz_partition_size' = 3 must divide"):
        run_distributed(_bad_hpz, 2)
