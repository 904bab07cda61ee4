"""ZeRO-Infinity's CPU tier: ``offload_param: cpu`` (stage 3), alone and with optimizer offload.

Parameter offload moves bytes, not arithmetic: the 16-bit shard lives in host memory and is copied
to the device for each gather, so every combination must equal plain stage 3 bit for bit in fp32
(same optimizer path: on-device AdamW, or the offloaded fused CPU kernel), and torch DDP to 1e-6,
with accumulation and clipping; bf16 within test_parity's tolerance.
"""

import pytest
import torch
from helpers import (
    build_model,
    max_loss_diff,
    max_param_diff,
    named_fp32,
    train_ddp,
    train_steps,
    train_zero,
    two_param_groups,
)

import hf_zero
from hf_zero.testing import run_distributed

STEPS, GAS, CLIP = 3, 2, 0.3
ZERO3 = dict(param_persistence_threshold=50)
BF16_TOL = 1e-2


def _combination(offload_optimizer: str, precision: str) -> dict:
    ref_losses, ref_params = train_ddp(STEPS, GAS, CLIP, precision=precision)
    kwargs = dict(offload_optimizer=offload_optimizer, precision=precision, **ZERO3)
    if offload_optimizer == "cpu":
        kwargs["offload_optimizer_fast_kernel"] = False  # the same AdamW as the DDP reference
    plain_losses, plain_params, _ = train_zero(STEPS, GAS, CLIP, 3, **kwargs)
    losses, params, engine = train_zero(STEPS, GAS, CLIP, 3, offload_param="cpu", **kwargs)
    sharded = [g for g in engine.groups + engine.frozen_groups if g.stage == 3]
    return {
        "equal_to_plain": losses == plain_losses
        and all(torch.equal(params[k], plain_params[k]) for k in params),
        "loss_vs_ddp": max_loss_diff(losses, ref_losses),
        "param_vs_ddp": max_param_diff(params, ref_params),
        "report": engine.memory_report(),
        "host_shard_bytes": sum(g.layout.shard_numel * g.tier.data.element_size() for g in sharded),
        "tiers": {type(g.tier).__name__ for g in sharded},
        # Whole on every rank: the small parameters stage 3 replicates (stage-2 buckets) and
        # small frozen ones outside any bucket.
        "replicated_bytes": sum(
            g.flat_param.numel() * g.flat_param.element_size()
            for g in engine.groups
            if g.stage == 2
        )
        + sum(
            p.numel() * p.element_size()
            for p in engine.module.parameters()
            if getattr(p, "_hf_zero_group", None) is None
        ),
    }


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("offload_optimizer", ["none", "cpu"])
def test_param_offload_equals_plain_stage3_and_ddp(offload_optimizer, world_size):
    for r in run_distributed(_combination, world_size, args=(offload_optimizer, "fp32")):
        assert r["tiers"] == {"HostTier"}, r["tiers"]
        assert r["equal_to_plain"], "parameter offload must not change a single bit (fp32)"
        assert r["loss_vs_ddp"] <= 1e-6 and r["param_vs_ddp"] <= 1e-6, r
        rep = r["report"]
        # Device parameters: only the small replicated ones; every shard is host memory.
        assert rep["params"] == r["replicated_bytes"], rep
        assert rep["host_params"] == r["host_shard_bytes"] > 0, rep


@pytest.mark.parametrize("offload_optimizer", ["none", "cpu"])
def test_param_offload_bf16_within_tolerance(offload_optimizer):
    for r in run_distributed(_combination, 2, args=(offload_optimizer, "bf16")):
        assert r["equal_to_plain"], "bf16: the same kernels on the same values"
        assert r["loss_vs_ddp"] <= BF16_TOL and r["param_vs_ddp"] <= BF16_TOL, r


def test_trainer_flag_reaches_the_config_and_wrong_stage_is_refused(tmp_path, monkeypatch):
    from hf_zero import ZeroTrainingArguments  # imports transformers' Trainer: only here

    monkeypatch.delenv("HF_ZERO_CONFIG", raising=False)
    args = ZeroTrainingArguments(output_dir=str(tmp_path), zero_stage=3, offload_param="cpu")
    assert args.zero.offload_param == "cpu"
    with pytest.raises(ValueError, match="'offload_param' = 'cpu' needs 'stage' = 3; got stage 2"):
        ZeroTrainingArguments(output_dir=str(tmp_path), zero_stage=2, offload_param="cpu")


def _resume_across_tiers(directory: str) -> dict:
    """Train with parameters on the host, save, resume without offload: the same numbers as
    training straight on."""

    def engine(**cfg):
        model = build_model()
        opt = torch.optim.AdamW(two_param_groups(model))
        return hf_zero.initialize(model, opt, stage=3, **ZERO3, **cfg), model

    offloaded, model = engine(offload_param="cpu")
    train_steps(offloaded, range(2))
    offloaded.save_checkpoint(directory)
    straight = train_steps(offloaded, range(2, 4))
    plain, plain_model = engine()
    plain.load_checkpoint(directory)
    resumed = train_steps(plain, range(2, 4))
    return {
        "straight": straight,
        "resumed": resumed,
        "params_equal": all(
            torch.equal(a, b)
            for a, b in zip(named_fp32(model).values(), named_fp32(plain_model).values())
        ),
    }


def test_checkpoint_from_the_cpu_tier_resumes_without_offload(tmp_path):
    for r in run_distributed(_resume_across_tiers, 2, args=(str(tmp_path / "ckpt"),)):
        assert r["resumed"] == r["straight"] and r["params_equal"], r
