"""ZeRO stages 0, 1, 2 against torch DDP, computed in the same processes on the same seeds.

fp32 tolerance: losses and every final parameter within 1e-6 relative (parameters: norm-wise,
||zero - ddp|| / ||ddp||). The algorithms are the same; only summation order differs (reduce-
scatter vs all-reduce, shard-wise vs tensor-wise norms), which moves fp32 results by ~1e-7 (measured: at most 2.2e-7 over these cases). The learning rate
is a fine-tuning one (1e-3): Adam divides by sqrt(v), so for elements whose gradient is nearly
zero a 1e-7 difference in the gradient becomes a larger difference in the update, and at 1e-2
stage 2 with accumulation drifts to ~8e-6 after three steps while its gradients still agree to
7e-8.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist
from helpers import (
    BUCKET,
    batch,
    build_model,
    max_loss_diff,
    max_param_diff,
    named_fp32,
    train_ddp,
    train_zero,
    two_param_groups,
)

import hf_zero
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


# --- the loop a DDP user writes, unchanged, over hf_zero --------------------------------------
# model(...) called directly, loss.backward(), no_sync() for accumulation, explicit
# clip_grad_norm_ (its return value checked against torch's), an LR scheduler, other
# elementwise optimizers, and overlap_comm off.


def sgd_momentum(groups):
    return torch.optim.SGD(groups, momentum=0.9, nesterov=True)


def adagrad(groups):
    return torch.optim.Adagrad(groups)


def halving(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def _ddp_style(stage: int, make_optimizer, overlap_comm: bool) -> dict:
    steps, gas, clip = 3, 3, 0.3
    ref_norms: list[float] = []
    ref_losses, ref_params = train_ddp(
        steps, gas, clip, make_optimizer=make_optimizer, make_scheduler=halving, norms=ref_norms
    )
    rank = dist.get_rank()
    model = build_model()
    optimizer = make_optimizer(two_param_groups(model))
    scheduler = halving(optimizer)
    engine = hf_zero.initialize(
        model, optimizer, stage=stage, reduce_bucket_size=BUCKET, overlap_comm=overlap_comm
    )
    losses, norms, post_clip, lrs = [], [], [], []
    for step in range(steps):
        for micro in range(gas):
            ctx = engine.no_sync() if micro < gas - 1 else contextlib.nullcontext()
            with ctx:
                x = batch(rank, step, micro)
                loss = model(input_ids=x, labels=x).loss
                (loss / gas).backward()
            losses.append(loss.item())
        norms.append(engine.clip_grad_norm_(clip))
        post_clip.append(engine.grad_norm_post_clip)
        engine.step()
        scheduler.step()
        lrs.append(optimizer.param_groups[1]["lr"])
    return {
        "loss": max_loss_diff(losses, ref_losses),
        "param": max_param_diff(named_fp32(model), ref_params),
        "norm": max(abs(a - b) / b for a, b in zip(norms, ref_norms)),
        "post_clip": post_clip,
        "lrs": lrs,
    }


@pytest.mark.parametrize(
    ("stage", "make_optimizer", "overlap_comm"),
    [(1, sgd_momentum, True), (2, sgd_momentum, False), (2, adagrad, True), (0, adagrad, False)],
    ids=["stage1-sgd", "stage2-sgd-no-overlap", "stage2-adagrad", "stage0-adagrad-no-overlap"],
)
def test_ddp_style_loop_matches_ddp(stage, make_optimizer, overlap_comm):
    for r in run_distributed(_ddp_style, 2, args=(stage, make_optimizer, overlap_comm)):
        assert r["loss"] <= FP32_TOL and r["param"] <= FP32_TOL, r
        assert r["norm"] <= FP32_TOL, "pre-clip norm differs from torch's clip_grad_norm_"
        assert all(abs(n - 0.3) < 1e-5 for n in r["post_clip"]), r["post_clip"]
        assert r["lrs"] == [2e-3 * 0.5**k for k in (1, 2, 3)]  # the scheduler drives the shards


# --- data-dependent control flow: a branch used on some ranks only ----------------------------


class TwoBranch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = torch.nn.Linear(8, 8)
        self.branch = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x, use_branch: bool):
        h = torch.tanh(self.trunk(x))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.head(h).pow(2).mean()


def _unused_branch(stage: int) -> dict:
    rank = dist.get_rank()
    results = {}
    for name in ("ddp", "zero"):
        torch.manual_seed(0)
        model = TwoBranch()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if name == "ddp":
            runner = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
        else:
            # Small buckets: the branch's bucket is never filled on rank 1.
            runner = hf_zero.initialize(model, optimizer, stage=stage, reduce_bucket_size=16)
        for step in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
            loss = runner(x, use_branch=(rank == 0 or step == 1))
            loss.backward()
            optimizer.step() if name == "ddp" else runner.step()
            optimizer.zero_grad()
        results[name] = named_fp32(model)
    return {"param": max_param_diff(results["zero"], results["ddp"])}


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_parameters_unused_on_some_ranks_match_ddp(stage):
    for r in run_distributed(_unused_branch, 2, args=(stage,)):
        assert r["param"] <= FP32_TOL, r
