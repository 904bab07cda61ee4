"""Collectives never change results: large buckets through the engine, every accumulation style.

On gloo, `Collectives` runs reduce-scatters and all-gathers as direct point-to-point exchanges
(faster there than gloo's own, and than the all-reduce earlier versions used in their place).
That path must give the same numbers as the native collectives and must never change a buffer
its caller still owns: stage 1 keeps accumulating into its flat gradient buffer between backward
passes, and the old all-reduce substitution, which summed into it in place, over-counted the
first micro-batch under DDP-style accumulation (two backward passes, one step, no ``no_sync``).

Each case trains a ~12.5M-parameter Llama (8 tokens a micro-batch) whose buckets hold >= 8 MiB
(checked), fp32 against torch DDP on the same seeds (1e-6), and fp32/bf16 against the same engine
with ``native_collectives: true`` (bit-identical at 2 ranks, where each sum is one addition
whatever the algorithm). The exchange path is seen to run (point-to-point sends), and not to run when
switched off.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist
from helpers import batch, max_loss_diff, max_param_diff, named_fp32

import hf_zero
from hf_zero.testing import run_distributed
from hf_zero.tiny import tiny_llama

BIG = dict(
    vocab_size=4096,
    hidden_size=640,
    intermediate_size=1728,  # one decoder layer (a stage-3 unit): 4.96M elements, 9.9 MB in bf16
    num_hidden_layers=2,
    num_attention_heads=10,
    num_key_value_heads=5,
    tie_word_embeddings=True,
)
BUCKET = 5_000_000  # elements: 20 MB fp32 / 10 MB bf16 per full bucket
STEPS, GAS, LR = 2, 2, 1e-3
MODES = ("ddp_style", "no_sync", "configured")
EIGHT_MIB = 8 << 20  # the size from which the old all-reduce substitution ran


def _model() -> torch.nn.Module:
    return tiny_llama(0, **BIG)


def _x(step: int, micro: int) -> torch.Tensor:
    # 8 tokens a micro-batch: the buckets, not the compute, are what this file is about.
    return batch(dist.get_rank(), step, micro, vocab=BIG["vocab_size"])[:, :4]


def _ddp(mode: str) -> tuple[list[float], dict]:
    model = _model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        for micro in range(GAS):
            skip = mode != "ddp_style" and micro < GAS - 1
            with ddp.no_sync() if skip else contextlib.nullcontext():
                x = _x(step, micro)
                loss = ddp(input_ids=x, labels=x).loss
                (loss / GAS).backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, named_fp32(model)


def _zero(mode: str, stage: int, precision: str, native: bool) -> tuple[list[float], dict, dict]:
    sends = []
    original = dist.isend

    def counting_isend(tensor, *args, **kwargs):
        sends.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    model = _model()
    engine = hf_zero.initialize(
        model,
        torch.optim.AdamW(model.parameters(), lr=LR),
        stage=stage,
        precision=precision,
        reduce_bucket_size=BUCKET,
        gradient_accumulation_steps=GAS if mode == "configured" else 1,
        native_collectives=native,
        param_persistence_threshold=0,
    )
    bucket_bytes = max(g.numel * (2 if precision == "bf16" else 4) for g in engine.groups)
    losses = []
    dist.isend = counting_isend
    try:
        for step in range(STEPS):
            for micro in range(GAS):
                x = _x(step, micro)
                if mode == "configured":
                    loss = engine(input_ids=x, labels=x).loss
                    engine.backward(loss)  # scaled by 1/GAS, steps at the window's end
                    engine.step()
                else:
                    skip = mode == "no_sync" and micro < GAS - 1
                    with engine.no_sync() if skip else contextlib.nullcontext():
                        loss = model(input_ids=x, labels=x).loss
                        (loss / GAS).backward()
                losses.append(loss.item())
            if mode != "configured":
                engine.step()
    finally:
        dist.isend = original
    info = {"bucket_bytes": bucket_bytes, "sends": len(sends)}
    return losses, named_fp32(model), info


def _compare(stage: int) -> dict:
    out = {}
    for mode in MODES:
        ref_losses, ref_params = _ddp(mode)
        for precision in ("fp32", "bf16"):
            fast_losses, fast_params, fast = _zero(mode, stage, precision, native=False)
            slow_losses, slow_params, slow = _zero(mode, stage, precision, native=True)
            out[(mode, precision)] = {
                "bucket_bytes": fast["bucket_bytes"],
                "exchange_sends": fast["sends"],
                "native_sends": slow["sends"],
                "identical": fast_losses == slow_losses
                and all(torch.equal(fast_params[k], slow_params[k]) for k in fast_params),
                "loss_vs_ddp": max_loss_diff(fast_losses, ref_losses),
                "param_vs_ddp": max_param_diff(fast_params, ref_params),
            }
    return out


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_large_buckets_equal_ddp_and_the_native_collectives(stage):
    results = run_distributed(_compare, 2, args=(stage,), timeout=600)
    for case, r in results[0].items():
        assert r["bucket_bytes"] >= EIGHT_MIB, (case, r)
        if stage > 0:
            # The exchange really ran, and the switch really turns it off.
            assert r["exchange_sends"] > 0 and r["native_sends"] == 0, (case, r)
        assert r["identical"], (case, r)
        if case[1] == "fp32":
            assert r["loss_vs_ddp"] <= 1e-6 and r["param_vs_ddp"] <= 1e-6, (case, r)


def _sgd_styles(stage: int) -> float:
    """bf16 with SGD (whose update is proportional to the gradient, unlike Adam's): DDP-style
    accumulation (two synced backward passes, one step) against configured accumulation."""
    from helpers import build_model

    results = []
    for mode in ("ddp_style", "configured"):
        model = build_model()
        engine = hf_zero.initialize(
            model,
            torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5),
            stage=stage,
            precision="bf16",
            gradient_accumulation_steps=GAS if mode == "configured" else 1,
        )
        for step in range(STEPS):
            for micro in range(GAS):
                x = batch(dist.get_rank(), step, micro)
                loss = model(input_ids=x, labels=x).loss
                if mode == "configured":
                    engine.backward(loss)
                    engine.step()
                else:
                    (loss / GAS).backward()
            if mode != "configured":
                engine.step()
        results.append(torch.cat([g.full_master() for g in engine.groups]))
    a, b = results
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_ddp_style_accumulation_equals_configured_accumulation(stage):
    """A 16-bit gradient buffer reduced in place must not count the first micro-batch N times:
    the two accumulation styles agree to bf16 rounding (an N-fold first micro-batch moves the
    weights by tens of percent of the update)."""
    for diff in run_distributed(_sgd_styles, 2, args=(stage,)):
        assert diff < 2e-3, diff
