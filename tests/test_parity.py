"""ZeRO stages 0, 1, 2 against torch DDP, computed in the same processes on the same seeds.

fp32 tolerance: losses and every final parameter within 1e-6 relative (parameters: norm-wise,
||zero - ddp|| / ||ddp||). The algorithms are the same; only summation order differs (reduce-
scatter vs all-reduce, shard-wise vs tensor-wise norms), which moves fp32 results by ~1e-7 (measured: at most 2.2e-7 over these cases). The learning rate
is a fine-tuning one (1e-3): Adam divides by sqrt(v), so for elements whose gradient is nearly
zero a 1e-7 difference in the gradient becomes a larger difference in the update, and at 1e-2
stage 2 with accumulation drifts to ~8e-6 after three steps while its gradients still agree to
7e-8.
"""

import pytest
from helpers import BUCKET, max_loss_diff, max_param_diff, train_ddp, train_zero

from hf_zero.testing import run_distributed

STEPS = 3
CLIP = 0.3  # below the gradient norm, so clipping engages on every step
FP32_TOL = 1e-6


def _parity_fp32(stage: int) -> dict:
    out = {}
    for gas in (1, 4):
        ref_losses, ref_params = train_ddp(STEPS, gas, clip=CLIP)
        losses, params, engine = train_zero(STEPS, gas, clip=CLIP, stage=stage)
        out[gas] = {
            "loss": max_loss_diff(losses, ref_losses),
            "param": max_param_diff(params, ref_params),
            "padding": max(g.layout.padding for g in engine.groups),
            "largest_param": max(p.numel() for g in engine.groups for p in g.params),
            "steps": engine.global_steps,
            "clipped": engine.grad_norm > CLIP,
        }
    return out


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_fp32_matches_ddp(stage, world_size):
    for rank_result in run_distributed(_parity_fp32, world_size, args=(stage,)):
        for gas, r in rank_result.items():
            assert r["steps"] == STEPS
            # The configurations the test claims to cover are really exercised.
            assert stage == 0 or r["padding"] > 0, "no bucket needed padding"
            assert r["largest_param"] > BUCKET, "no parameter larger than a bucket"
            assert r["clipped"], "clipping never engaged"
            assert r["loss"] <= FP32_TOL, f"gas={gas}: loss differs by {r['loss']:.2e}"
            assert r["param"] <= FP32_TOL, f"gas={gas}: params differ by {r['param']:.2e}"


# bf16 keeps 8 significant bits (unit roundoff 2**-8 = 3.9e-3). The reference is DDP on a bf16
# model with fp32 master weights kept by hand. Stages 0-1 do the same arithmetic (measured: equal
# bit for bit on gloo). Stage 2 reduce-scatters every micro-batch and accumulates the shard in
# fp32 where DDP accumulates micro-batches in bf16, so the two differ by about one bf16 rounding
# of the gradient per micro-batch (measured: 2.9e-3 in parameters, 2.5e-5 in losses). We allow
# 1e-2 relative on both: 2.5 bf16 ulps.
BF16_TOL = 1e-2


def _parity_bf16(stage: int) -> dict:
    ref_losses, ref_params = train_ddp(STEPS, 2, clip=CLIP, precision="bf16")
    losses, params, _ = train_zero(STEPS, 2, clip=CLIP, stage=stage, precision="bf16")
    return {"loss": max_loss_diff(losses, ref_losses), "param": max_param_diff(params, ref_params)}


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_bf16_matches_ddp_within_tolerance(stage):
    for r in run_distributed(_parity_bf16, 2, args=(stage,)):
        assert r["loss"] <= BF16_TOL, r
        assert r["param"] <= BF16_TOL, r
