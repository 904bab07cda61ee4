"""The GPU lane's checks: one rank, every ZeRO mode, against plain torch in the same process.

`make gpu-check` (scripts/gpu_check.py, docs/GPU.md) runs this module with
``HF_ZERO_TEST_DEVICE=cuda``: one rank on ``cuda:0`` over NCCL with hf_zero's gloo control group
beside it, pinned host buffers and CUDA events for offload, bf16 on the GPU, the CUDA RNG in
checkpoints. NCCL refuses two ranks on one GPU, so a one-GPU machine runs one rank here; the lane
runs the multi-rank tests beside it on CPU (gloo). In the ordinary suite the same module runs on
one CPU rank (gloo), so the lane's code runs on every CI run, not only when a GPU is lent.

Each test records the rank's peak ``torch.cuda.max_memory_allocated`` (0 on CPU) as the JUnit
property ``peak_cuda_bytes``, which the lane's JSON reports per test.

Tolerances (losses relative, parameters norm-wise relative per tensor, after 3 steps of 2
micro-batches with clipping): fp32 1e-6 on CPU, where the same kernels see the same values (only
the clipping norm's summation order differs, ~1e-7); 1e-5 on CUDA, where cuBLAS chooses kernels by
the operands' alignment and a parameter inside a flat buffer may take another kernel than a
separate tensor (last-bit differences, then amplified by Adam's 1/sqrt(v) as in test_parity).
bf16 and offload 1e-2 (test_parity's bf16 bound: 16-bit rounding of parameters and gradients).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import (
    DEVICE,
    batch,
    build_model,
    lora_engine,
    lora_model,
    max_loss_diff,
    max_param_diff,
    train_ddp,
    train_on_corpus,
    train_steps,
    train_zero,
    zero_engine,
)

import hf_zero
from hf_zero.numerics.quant import dequantize, quantize
from hf_zero.testing import run_distributed

CUDA = DEVICE.type == "cuda"
FP32_TOL = 1e-5 if CUDA else 1e-6
BF16_TOL = 1e-2
STEPS, GAS, CLIP = 3, 2, 0.3


def _peak() -> int:
    return torch.cuda.max_memory_allocated() if CUDA else 0


def _reset_peak() -> None:
    if CUDA:
        # Same kernels, same order for hf_zero and the reference (warn, not fail, where an op
        # has no deterministic CUDA kernel).
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.cuda.reset_peak_memory_stats()


def _parity(precision: str, **cfg) -> dict:
    _reset_peak()
    ref_losses, ref_params = train_ddp(STEPS, GAS, clip=CLIP, precision=precision)
    _reset_peak()
    losses, params, engine = train_zero(STEPS, GAS, clip=CLIP, precision=precision, **cfg)
    return {
        "loss": max_loss_diff(losses, ref_losses),
        "param": max_param_diff(params, ref_params),
        "device": str(engine.device),
        "backend": dist.get_backend(),
        "peak": _peak(),
    }


def _check_parity(record_property, precision: str, **cfg) -> None:
    """One rank of `_parity` with ``cfg``: on the lane's device and backend, within the
    precision's tolerance; its peak device memory recorded for the lane's report."""
    r = run_distributed(_parity, 1, args=(precision,), kwargs=cfg)[0]
    record_property("peak_cuda_bytes", r["peak"])
    assert r["device"].startswith(DEVICE.type), r
    assert r["backend"] == ("nccl" if CUDA else "gloo"), r
    tol = FP32_TOL if precision == "fp32" else BF16_TOL
    assert r["loss"] <= tol and r["param"] <= tol, r


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_matches_torch(stage, precision, record_property):
    _check_parity(record_property, precision, stage=stage)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_bf16_matches_torch(stage, record_property):
    _check_parity(record_property, "bf16", stage=stage, offload_optimizer="cpu")


def test_param_offload_bf16_matches_torch(record_property):
    """ZeRO-Infinity's CPU tier with the optimizer on the host too (the Hugging Face docs' ZeRO-3
    JSON): pinned host shards copied to the device for every gather."""
    _check_parity(record_property, "bf16", stage=3, offload_optimizer="cpu", offload_param="cpu")


def test_zeropp_config_matches_torch(record_property):
    """qwZ + qgZ configured at one rank: a one-rank gather moves nothing to quantize, so the run
    stays within the bf16 tolerance of torch; the quantizer itself is checked on the device
    below."""
    _check_parity(
        record_property, "bf16", stage=3, quantized_weights=True, quantized_gradients=True
    )


def _quantizer() -> dict:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1 << 20, generator=g) * torch.rand(1 << 20, generator=g)
    out = {}
    for bits in (8, 4):
        here, cpu = quantize(x.to(DEVICE), bits), quantize(x, bits)
        back = dequantize(here).cpu()
        bound = (cpu.scales.repeat_interleave(cpu.block_size, dim=1)[0, : x.numel()] / 2).cpu()
        out[bits] = {
            "payload_equal": float((here.data.cpu() == cpu.data).float().mean()),
            "scales_rel": ((here.scales.cpu() - cpu.scales).abs().max() / cpu.scales.max()).item(),
            "within_half_step": bool(((back - x).abs() <= bound * 1.0001 + 1e-12).all()),
        }
    return {"quant": out, "peak": _peak()}


def test_quantizer_on_device_matches_cpu(record_property):
    r = run_distributed(_quantizer, 1)[0]
    record_property("peak_cuda_bytes", r["peak"])
    for bits, q in r["quant"].items():
        assert q["within_half_step"], (bits, q)
        assert q["scales_rel"] <= 1e-6, (bits, q)
        # Rounding ties may land one step apart across devices; nothing more.
        assert q["payload_equal"] >= 0.999, (bits, q)


def _mixz(steps: int) -> dict:
    result = {}
    for name, mixz in {"bf16": False, "mixz": True}.items():
        torch.manual_seed(0)
        _reset_peak()
        engine = lora_engine(lora_model(), precision="bf16", quantized_nontrainable_weights=mixz)
        losses = train_on_corpus(engine, steps)
        result[name] = sum(losses[-5:]) / 5
        result[name + "_first"] = losses[0]
        result[name + "_int8"] = engine.memory_report().get("quantized_params", 0)
    result["peak"] = _peak()
    return result


def test_mixz_lora_tracks_bf16(record_property):
    r = run_distributed(_mixz, 1, args=(30,))[0]
    record_property("peak_cuda_bytes", r["peak"])
    assert r["mixz_int8"] > 0 and r["bf16_int8"] == 0, r
    assert r["bf16"] < 0.8 * r["bf16_first"], r  # it learned
    assert abs(r["mixz"] - r["bf16"]) <= 0.02 * r["bf16"], r


def _checkpoint_round_trip(directory: str) -> dict:
    _reset_peak()
    a = zero_engine(build_model(), stage=3, precision="bf16")
    train_steps(a, range(2))
    a.save_checkpoint(directory)
    draw_after_save = torch.rand(4, device=DEVICE).cpu()
    continued = train_steps(a, range(2, 4))
    b = zero_engine(build_model(), stage=3, precision="bf16")
    b.load_checkpoint(directory)
    draw_after_load = torch.rand(4, device=DEVICE).cpu()
    resumed = train_steps(b, range(2, 4))
    from safetensors import safe_open

    with safe_open(f"{directory}/zero_rank00000.safetensors", "pt") as f:
        keys = set(f.keys())
    return {
        "continued": continued,
        "resumed": resumed,
        "rng_equal": bool(torch.equal(draw_after_save, draw_after_load)),
        "cuda_rng_saved": "rng.cuda" in keys,
        "peak": _peak(),
    }


def test_checkpoint_round_trip_restores_training_and_rng(tmp_path, record_property):
    r = run_distributed(_checkpoint_round_trip, 1, args=(str(tmp_path / "ckpt"),))[0]
    record_property("peak_cuda_bytes", r["peak"])
    assert r["rng_equal"], r
    assert r["cuda_rng_saved"] == CUDA, r
    assert r["resumed"] == r["continued"], r


def _qlora(path: str) -> dict:
    """An NF4 base (bf16 storage) with fp32 adapters: plain torch, then stage 3, same steps."""
    from helpers import load_quantized

    _reset_peak()
    losses = {}
    for name in ("torch", "zero3"):
        model = load_quantized(path, "nf4-bf16", dtype=torch.float32)
        adapters = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(adapters, lr=1e-3)
        engine = None
        if name == "zero3":
            engine = hf_zero.initialize(model, opt, stage=3, precision="fp32")
        losses[name] = []
        for step in range(STEPS):
            x = batch(0, step, 0, vocab=256)
            loss = (engine or model)(input_ids=x, labels=x).loss
            if engine is None:
                loss.backward()
                opt.step()
                opt.zero_grad()
            else:
                engine.backward(loss)
                engine.step()
                engine.zero_grad()
            losses[name].append(loss.item())
    return {**losses, "device": str(engine.device), "peak": _peak()}


def test_qlora_nf4_base_matches_torch(tmp_path, record_property):
    pytest.importorskip("bitsandbytes")
    from helpers import QLORA_MODEL

    from hf_zero.tiny import tiny_llama

    tiny_llama(0, initializer_range=0.2, **QLORA_MODEL).save_pretrained(tmp_path)
    r = run_distributed(_qlora, 1, args=(str(tmp_path),))[0]
    record_property("peak_cuda_bytes", r["peak"])
    assert r["device"].startswith(DEVICE.type), r
    assert max(abs(a - b) for a, b in zip(r["torch"], r["zero3"])) <= FP32_TOL, r


def _checkpoint_offload_peaks() -> dict:
    """Peak device memory of 2 steps of a 6-layer model at 1024 tokens a row under activation
    checkpointing, without and with ``offload_checkpoints``; and their losses."""
    out = {}
    for offload in (False, True):
        torch.manual_seed(0)
        model = build_model(0, checkpointing=True, num_hidden_layers=6, hidden_size=128)
        model.train()
        engine = hf_zero.initialize(
            model, torch.optim.SGD(model.parameters(), lr=0.1), offload_checkpoints=offload
        )
        ids = torch.randint(0, 251, (2, 1024), generator=torch.Generator().manual_seed(3))
        ids = ids.to(DEVICE)
        _reset_peak()
        losses = []
        for _ in range(2):
            loss = engine(input_ids=ids, labels=ids, use_cache=False).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out[offload] = (losses, _peak())
        engine.close()
    return out


def test_checkpoint_offload_keeps_losses_and_lowers_the_device_peak(record_property):
    """On CPU the same path runs with no memory effect (bit-identical losses); on CUDA the
    layers' saved inputs leave the device, so the peak drops (both peaks recorded)."""
    r = run_distributed(_checkpoint_offload_peaks, 1)[0]
    (plain, plain_peak), (offloaded, offloaded_peak) = r[False], r[True]
    record_property("peak_cuda_bytes", offloaded_peak)
    record_property("peak_cuda_bytes_without_offload", plain_peak)
    assert max_loss_diff(offloaded, plain) <= FP32_TOL, (offloaded, plain)
    if CUDA:
        assert offloaded_peak < plain_peak, (offloaded_peak, plain_peak)
