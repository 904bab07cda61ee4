"""ZeRO-Offload: fp32 master weights, gradients and Adam state in host memory.

Exactness: the offloaded step runs the same elementwise arithmetic on the same fp32 values, only
in host memory, so with the same optimizer kernel (AdamW(fused=True) is the kernel the fast CPU
path uses) offloaded and on-device training are equal bit for bit. Against DDP the usual 1e-6.
"""

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
    train_steps,
    train_zero,
    two_param_groups,
)

import hf_zero
from hf_zero.optim import CPUAdam
from hf_zero.testing import run_distributed

STEPS, GAS, CLIP = 3, 2, 0.3
ZERO3 = dict(param_persistence_threshold=50)


def fused_adamw(groups):
    return torch.optim.AdamW(groups, fused=True)


def cpu_adam(groups):
    return CPUAdam(groups)


def _offload(stage: int, make_optimizer) -> dict:
    extra = ZERO3 if stage == 3 else {}
    ref_losses, ref_params = train_ddp(STEPS, GAS, CLIP, make_optimizer=make_optimizer)
    on_losses, on_params, _ = train_zero(
        STEPS, GAS, CLIP, stage, make_optimizer=fused_adamw, **extra
    )
    off_losses, off_params, engine = train_zero(
        STEPS, GAS, CLIP, stage, make_optimizer=make_optimizer, offload_optimizer="cpu", **extra
    )
    return {
        "equal_to_on_device": off_losses == on_losses
        and all(torch.equal(off_params[k], on_params[k]) for k in on_params),
        "loss_vs_ddp": max_loss_diff(off_losses, ref_losses),
        "param_vs_ddp": max_param_diff(off_params, ref_params),
        "report": engine.memory_report(),
        "shard": sum(g.layout.shard_numel for g in engine.groups),
        "offloaded": all(g.offload and g.master.device.type == "cpu" for g in engine.groups),
        "step_bytes": sum(
            s["step"].numel() * s["step"].element_size()
            for s in engine.optimizer.optimizer.state.values()
        ),
    }


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("make_optimizer", [fused_adamw, cpu_adam], ids=["torch-adamw", "cpu-adam"])
def test_offload_equals_on_device_exactly_and_ddp(stage, make_optimizer):
    for r in run_distributed(_offload, 2, args=(stage, make_optimizer)):
        assert r["offloaded"]
        assert r["equal_to_on_device"], "offloaded fp32 training must be bit-identical"
        assert r["loss_vs_ddp"] <= 1e-6 and r["param_vs_ddp"] <= 1e-6, r
        rep, shard = r["report"], r["shard"]
        # Nothing of the optimizer stays on the device; the host holds 12 bytes per shard elem.
        assert rep["optimizer_states"] == 0 and rep["master_weights"] == 0
        assert rep["host_master_weights"] == 4 * shard
        assert rep["host_optimizer_states"] - r["step_bytes"] == 8 * shard


def _default_adamw(stage: int) -> dict:
    # The user's default AdamW (for-loop kernel) is stepped by the fused CPU kernel when offloaded:
    # the same formula, rounded differently in the last bit.
    ref_losses, ref_params = train_ddp(STEPS, GAS, CLIP)
    losses, params, engine = train_zero(STEPS, GAS, CLIP, stage, offload_optimizer="cpu")
    return {
        "loss": max_loss_diff(losses, ref_losses),
        "param": max_param_diff(params, ref_params),
        "lrs": [g["lr"] for g in engine.optimizer.optimizer.param_groups],
    }


def test_user_adamw_is_offloaded_with_its_hyperparameters():
    for r in run_distributed(_default_adamw, 2, args=(2,)):
        assert r["loss"] <= 1e-6 and r["param"] <= 1e-6, r
        assert r["lrs"] == [1e-3, 2e-3]  # the two param groups kept their learning rates


def _grads_on_host() -> dict:
    model = build_model()
    engine = hf_zero.initialize(
        model,
        torch.optim.AdamW(two_param_groups(model)),
        stage=2,
        offload_optimizer="cpu",
        reduce_bucket_size=BUCKET,
    )
    x = batch(dist.get_rank(), 0, 0)
    engine.backward(engine(input_ids=x, labels=x).loss)
    engine.optimizer.prepare_grads()
    return {
        "report": engine.memory_report(),
        "shard": sum(g.layout.shard_numel for g in engine.groups),
        "full_grads": [n for n, p in model.named_parameters() if p.grad is not None],
    }


def test_gradient_shards_are_copied_to_host_after_reduction():
    for r in run_distributed(_grads_on_host, 2):
        assert r["full_grads"] == []
        assert r["report"]["grads"] == 0 and r["report"]["host_grads"] == 4 * r["shard"]


def test_cpu_adam_matches_torch_fused_adamw_bit_for_bit():
    torch.manual_seed(0)
    n = 300_007
    ours = torch.nn.Parameter(torch.randn(n))
    theirs = torch.nn.Parameter(ours.detach().clone())
    opt_ours = CPUAdam([ours], lr=1e-3, weight_decay=0.1, tile_numel=4096)
    opt_theirs = torch.optim.AdamW([theirs], lr=1e-3, weight_decay=0.1, fused=True)
    for _ in range(4):
        g = torch.randn(n)
        ours.grad, theirs.grad = g.clone(), g.clone()
        opt_ours.step()
        opt_theirs.step()
    assert torch.equal(ours, theirs)
    assert opt_ours.state_dict()["state"][0].keys() == opt_theirs.state_dict()["state"][0].keys()


def test_cpu_adam_bf16_state_halves_memory_within_stated_error():
    torch.manual_seed(0)
    n = 100_000
    start = torch.randn(n)
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        p = torch.nn.Parameter(start.clone())
        opt = CPUAdam([p], lr=1e-3, state_dtype=dtype)
        gen = torch.Generator().manual_seed(1)
        for _ in range(10):
            p.grad = torch.randn(n, generator=gen)
            opt.step()
        state = opt.state[p]
        runs[dtype] = (p.detach() - start, state["exp_avg"].element_size())
    (update32, bytes32), (update16, bytes16) = runs[torch.float32], runs[torch.bfloat16]
    assert (bytes32, bytes16) == (4, 2)
    # Moments rounded to 8 significant bits: the accumulated update differs by < 1% relative.
    assert ((update16 - update32).norm() / update32.norm()).item() < 1e-2


def test_cpu_adam_rejects_unknown_state_dtype():
    with pytest.raises(ValueError, match=r"'state_dtype' = torch\.float16; allowed"):
        CPUAdam([torch.nn.Parameter(torch.zeros(2))], state_dtype=torch.float16)


def _kernel_choice(fast_kernel: bool) -> dict:
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("hf_zero.optim.sharded").addHandler(handler)
    on_losses, on_params, _ = train_zero(STEPS, GAS, CLIP, 3, **ZERO3)  # default AdamW, on device
    off_losses, off_params, engine = train_zero(
        STEPS, GAS, CLIP, 3, offload_optimizer="cpu",
        offload_optimizer_fast_kernel=fast_kernel, **ZERO3,
    )  # fmt: skip
    return {
        "fast_kernel": engine.optimizer.fast_kernel,
        "equal_to_on_device": off_losses == on_losses
        and all(torch.equal(off_params[k], on_params[k]) for k in on_params),
        "logged": [m for m in records if "fused CPU Adam kernel" in m],
        "rank": dist.get_rank(),
    }


@pytest.mark.parametrize("fast_kernel", [True, False], ids=["fused-kernel", "your-step"])
def test_offload_kernel_swap_is_said_and_can_be_turned_off(fast_kernel):
    """The user's default (foreach) AdamW: by default the offloaded step runs torch's fused CPU
    kernel (one warning on rank 0 says so); with ``offload_optimizer_fast_kernel: false`` the
    user's own ``step()`` runs on the host and training is bit-identical to on-device."""
    for r in run_distributed(_kernel_choice, 2, args=(fast_kernel,)):
        assert r["fast_kernel"] is fast_kernel
        expected = 1 if fast_kernel and r["rank"] == 0 else 0
        assert len(r["logged"]) == expected, r["logged"]
        if not fast_kernel:
            assert r["equal_to_on_device"]


def _fused_choice() -> list[str]:
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("hf_zero.optim.sharded").addHandler(handler)
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)  # transformers' default
    hf_zero.initialize(model, optimizer, stage=2, offload_optimizer="cpu")
    return records


def test_offload_with_fused_adamw_says_nothing():
    """fused=True is what the fast kernel runs anyway: nothing changes, nothing to warn about."""
    for records in run_distributed(_fused_choice, 2):
        assert not [m for m in records if "fused CPU Adam kernel" in m], records


def _copy_back(overlap: bool) -> dict:
    model = build_model()
    engine = hf_zero.initialize(
        model,
        cpu_adam(two_param_groups(model)),
        stage=3,
        offload_optimizer="cpu",
        reduce_bucket_size=BUCKET,
        **ZERO3,
    )
    engine.optimizer.overlap_copy_back = overlap  # the GPU benchmark's switch
    train_steps(engine, range(3))
    return named_fp32(model)


def test_copy_back_overlap_changes_no_value():
    tiled, whole = (run_distributed(_copy_back, 2, args=(o,)) for o in (True, False))
    for a, b in zip(tiled, whole):
        assert all(torch.equal(a[k], b[k]) for k in a)


def _partial(stage: int) -> dict:
    extra = dict(make_optimizer=fused_adamw, **(ZERO3 if stage == 3 else {}))
    on_losses, on_params, _ = train_zero(STEPS, GAS, CLIP, stage, **extra)
    full_losses, full_params, _ = train_zero(
        STEPS, GAS, CLIP, stage, offload_optimizer="cpu", **extra
    )
    out = {}
    for ratio in (0.0, 0.5):
        losses, params, engine = train_zero(
            STEPS, GAS, CLIP, stage, offload_optimizer="cpu", offload_optimizer_ratio=ratio,
            **extra,
        )  # fmt: skip
        host = [g for g in engine.groups if g.master_weights.location == "host"]
        report = engine.memory_report()
        out[ratio] = {
            "equal_to_on_device": losses == on_losses
            and all(torch.equal(params[k], on_params[k]) for k in on_params),
            "equal_to_full_offload": losses == full_losses
            and all(torch.equal(params[k], full_params[k]) for k in full_params),
            "host_buckets": len(host),
            "buckets": len(engine.groups),
            "host_share": sum(g.numel for g in host) / sum(g.numel for g in engine.groups),
            "host_shard_bytes": 4 * sum(g.layout.shard_numel for g in host),
            "device_shard_bytes": 4 * sum(g.layout.shard_numel for g in engine.groups)
            - 4 * sum(g.layout.shard_numel for g in host),
            "report": report,
            "step": type(engine.optimizer.master_step).__name__,
        }
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_partial_offload_equals_full_offload_and_none_exactly(stage):
    """``offload_optimizer_ratio`` (DeepSpeed's ``offload_optimizer.ratio``): that share of the
    buckets keeps its master, gradient and Adam state in host memory and is stepped there, the
    rest on the device; the arithmetic is the same elementwise AdamW kernel everywhere, so the
    results equal full offload and no offload bit for bit."""
    for r in run_distributed(_partial, 2, args=(stage,)):
        none, half = r[0.0], r[0.5]
        assert none["equal_to_on_device"] and none["equal_to_full_offload"], none
        assert half["equal_to_on_device"] and half["equal_to_full_offload"], half
        assert none["host_buckets"] == 0 and none["step"] == "DeviceStep", none
        assert 0 < half["host_buckets"] < half["buckets"] and half["step"] == "SplitStep", half
        assert 0.25 <= half["host_share"] <= 0.75, half  # whole buckets, nearest to half
        report = half["report"]
        # The master shards by where they live (fp32 on device: the parameters themselves
        # when stage < 3 aliases them, so only the host share is a copy to count).
        assert report["host_master_weights"] == half["host_shard_bytes"], report
        assert report["host_optimizer_states"] > 0 and report["optimizer_states"] > 0, report
        host_moments = 2 * half["host_shard_bytes"]  # exp_avg, exp_avg_sq; plus step counters
        assert host_moments <= report["host_optimizer_states"] <= host_moments + 64, report


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offloaded_master_loads_state_in_the_cpu_adams_dtype(dtype):
    # A checkpoint's state (saved in either dtype) is kept as the optimizer keeps it.
    from hf_zero.sharding.master import HostMaster

    master = HostMaster(torch.zeros(8), world=1, pin=False)
    opt = CPUAdam([master.param], lr=1e-3, state_dtype=dtype)
    for saved in (torch.float32, torch.bfloat16):
        moments = {k: torch.ones(8, dtype=saved) for k in ("exp_avg", "exp_avg_sq")}
        master.load(torch.ones(8), {"step": torch.tensor(3.0), **moments}, opt, placement=None)
        state = opt.state[master.param]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == dtype
        assert state["step"].dtype == torch.float32
