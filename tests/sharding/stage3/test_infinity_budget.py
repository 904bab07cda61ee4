"""ZeRO-Infinity with host memory to spare: ``offload_optimizer_max_in_cpu`` keeps the first
buckets' master, gradient and optimizer state in host memory (stepped there, as
``offload_optimizer: cpu`` steps them) and streams the rest from swap files.

Where the state lives changes no arithmetic (the user's AdamW, elementwise, on the same fp32
values), so at every budget the run equals plain stage 3 bit for bit, and a checkpoint saved at
one budget resumes exactly at another.
"""

import pytest
import torch
from helpers import batch, train_zero
from test_infinity import CLIP, GAS, STEPS, ZERO3, _cfg, _segment

from hf_zero.config.zero_config import ZeroConfig
from hf_zero.memory import ModelShape, infinity_bytes
from hf_zero.testing import run_distributed


def _optimizer_cache(nvme: str) -> dict:
    plain_losses, plain_params, _ = train_zero(STEPS, GAS, CLIP, 3, **ZERO3)
    out, total = {}, None
    for share in (0.0, 0.5, 1.0):
        budget = 0 if total is None else int(total * share)
        cfg = _cfg("nvme", "nvme", nvme, offload_optimizer_max_in_cpu=budget)
        losses, params, engine = train_zero(STEPS, GAS, CLIP, 3, **cfg)
        total = sum(g.layout.shard_numel for g in engine.groups)
        host = [g for g in engine.groups if g.master_weights.location == "host"]
        swap = engine.swaps["offload_optimizer"]
        out[share] = {
            "equal_to_plain": losses == plain_losses
            and all(torch.equal(params[k], plain_params[k]) for k in params),
            "budget": budget,
            "host_numel": sum(g.layout.shard_numel for g in host),
            "host_buckets": len(host),
            "buckets": len(engine.groups),
            "step": type(engine.optimizer.master_step).__name__,
            "report": engine.memory_report(),
            "optimizer_files": [f.path.name for f in swap.files if "param" not in f.path.name],
            "padded": sum(g.numel for g in engine.groups),  # the estimate's P
        }
        engine.close()
    return out


def test_an_optimizer_host_budget_steps_the_cached_buckets_in_memory_and_changes_no_result(
    tmp_path,
):
    for r in run_distributed(_optimizer_cache, 2, args=(str(tmp_path),)):
        none, half, whole = r[0.0], r[0.5], r[1.0]
        assert all(x["equal_to_plain"] for x in (none, half, whole)), r
        assert none["host_buckets"] == 0 and none["step"] == "StreamedStep", none
        assert 0 < half["host_buckets"] < half["buckets"] and half["step"] == "SplitStep", half
        assert 0 < half["host_numel"] <= half["budget"], half
        assert whole["host_buckets"] == whole["buckets"] and whole["step"] == "HostStep", whole
        assert whole["optimizer_files"] == [], whole  # nothing of the optimizer on disk
        # Host bytes: 4 per cached master element, 8 for the two Adam moments (plus counters);
        # the swap files hold only the rest.
        for x in (half, whole):
            report, cached = x["report"], 4 * x["host_numel"]
            assert report["host_master_weights"] == cached, report
            assert 2 * cached <= report["host_optimizer_states"] <= 2 * cached + 64, report
        # hf-zero estimate --optimizer-max-in-cpu: the same split (files padded to 4 KiB blocks).
        estimate = infinity_bytes(ModelShape(params=x["padded"]), 2, "fp32", True, **{
            "optimizer_cache_numel": x["host_numel"]})  # fmt: skip
        # 16 bytes an element: master, moments (measured here, after the step) and gradient.
        held = report["host_master_weights"] + report["host_optimizer_states"]
        assert 0 <= held - 12 / 16 * estimate["host_optimizer_cache"] <= 64, (held, estimate)
        for kind in ("nvme_master_weights", "nvme_grads", "nvme_optimizer_states"):
            assert 0 <= x["report"][kind] - estimate[kind] <= 2 * 4096 * x["buckets"], kind
    streamed = none["report"]["nvme_master_weights"]
    assert 0 < half["report"]["nvme_master_weights"] < streamed, r
    assert whole["report"].get("nvme_master_weights", 0) == 0, whole


@pytest.mark.slow
def test_a_checkpoint_moves_between_optimizer_budgets_exactly(tmp_path):
    """Saved with half the optimizer cached, resumed with all of it on disk and with none:
    the same losses and parameters as one uninterrupted run."""
    swap = str(tmp_path / "swap")
    half = _cfg("nvme", "nvme", swap, offload_optimizer_max_in_cpu=10_000)
    streamed = _cfg("nvme", "nvme", swap)
    ckpt = str(tmp_path / "ckpt")
    straight = run_distributed(_segment, 2, args=(dict(ZERO3), 0, 4, None, None))[0]
    run_distributed(_segment, 2, args=(half, 0, 2, None, ckpt))
    for cfg in (half, streamed):
        resumed = run_distributed(_segment, 2, args=(cfg, 2, 4, ckpt, None))[0]
        assert resumed["losses"] == straight["losses"][2:], cfg
        assert all(
            torch.equal(resumed["params"][k], straight["params"][k]) for k in straight["params"]
        )


def test_the_optimizer_budget_is_checked():
    cfg = ZeroConfig(
        stage=3, offload_optimizer="nvme", nvme_path="/tmp", offload_optimizer_max_in_cpu=1e9
    )
    assert cfg.offload_optimizer_max_in_cpu == 1_000_000_000
    with pytest.raises(
        ValueError, match=r"'offload_optimizer_max_in_cpu' = 5 needs 'offload_optimizer' = 'nvme'"
    ):
        ZeroConfig(stage=3, offload_optimizer="cpu", offload_optimizer_max_in_cpu=5)
    with pytest.raises(ValueError, match=r"'offload_optimizer_max_in_cpu' = -1"):
        ZeroConfig(
            stage=3, offload_optimizer="nvme", nvme_path="/tmp", offload_optimizer_max_in_cpu=-1
        )


def _one_file(nvme: str, precision: str) -> dict:
    cfg = _cfg("nvme", "nvme", nvme)
    _, _, engine = train_zero(1, GAS, CLIP, 3, precision=precision, **cfg)
    swap = engine.swaps["offload_optimizer"]
    before = dict(swap.stats)
    for micro in range(GAS):
        x = batch(torch.distributed.get_rank(), 1, micro)
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
    shard = sum(g.layout.shard_numel for g in engine.groups)
    sharded = [g for g in engine.groups if g.stage == 3]  # small ones stay whole
    out = {
        "shared": [g.tier.shared for g in sharded],
        "same_file": [g.tier.file is g.master_weights.swapped.files["master"] for g in sharded],
        "master_files": sum(f.path.name.endswith(".master") for f in swap.files),
        "whole_groups": len(engine.groups) - len(sharded),
        "report": engine.memory_report(),
        "shard_bytes": 4 * shard,
        "written": swap.stats["write_bytes"] - before["write_bytes"],
        "read": swap.stats["read_bytes"] - before["read_bytes"],
        "padding": 4096 * len(engine.groups) * 8,
    }
    engine.close()
    return out


def test_fp32_parameters_and_masters_share_one_file(tmp_path):
    """fp32 ``nvme``/``nvme``: a group's parameter shard and master are the same numbers, kept
    in one file (16 bytes per element on disk: master = parameter, gradient, two moments); the
    step writes each updated tile once, and gathers read the master's bytes. In bf16 the
    parameter shard is its own 2-byte file."""
    fp32 = run_distributed(_one_file, 2, args=(str(tmp_path), "fp32"))
    bf16 = run_distributed(_one_file, 2, args=(str(tmp_path), "bf16"))
    for r in fp32:
        assert all(r["shared"]) and all(r["same_file"]), r
        assert r["master_files"] == r["whole_groups"], r  # only groups with no parameter file
        report, shard = r["report"], r["shard_bytes"]
        assert report["nvme_params"] == 0, report  # counted once, as the master's
        assert 0 <= report["nvme_total"] - 4 * shard <= r["padding"], (report, shard)
        # A step writes each micro-batch's gradient sum, then the master (= the parameters)
        # and two moments once: no separate parameter write.
        assert 0 <= r["written"] - (GAS + 3) * shard <= r["padding"], r
    for r in bf16:
        assert not any(r["shared"]) and r["master_files"] == len(r["shared"]) + r["whole_groups"]
