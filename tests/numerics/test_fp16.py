"""fp16 dynamic loss scaling: an overflow on one rank skips the step on every rank."""

import pytest
import torch
from helpers import BUCKET, build_model, named_fp32, train_step, two_param_groups

import hf_zero
from hf_zero.testing import run_distributed


def _overflow(stage: int, hysteresis: int) -> dict:
    model = build_model()
    engine = hf_zero.initialize(
        model,
        torch.optim.AdamW(two_param_groups(model)),
        stage=stage,
        precision="fp16",
        initial_scale_power=10,
        hysteresis=hysteresis,
        gradient_clipping=1.0,
        reduce_bucket_size=BUCKET,
    )

    out = {"first": train_step(engine, model, 0), "scales": [engine.loss_scale]}
    for step in (1, 2):
        before = named_fp32(model)
        out[f"stepped_{step}"] = train_step(engine, model, step, poison=True)
        out[f"unchanged_{step}"] = all(
            torch.equal(before[n], p) for n, p in named_fp32(model).items()
        )
        out["scales"].append(engine.loss_scale)
    before = named_fp32(model)
    out["recovered"] = train_step(engine, model, 3)
    out["moved_after"] = not all(torch.equal(before[n], p) for n, p in named_fp32(model).items())
    out["skipped"] = engine.skipped_steps
    out["global_steps"] = engine.global_steps
    out["adam_steps"] = [int(s["step"]) for s in engine.optimizer.optimizer.state.values()]
    return out


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_overflow_skips_step_on_every_rank_and_lowers_scale(stage):
    for r in run_distributed(_overflow, 2, args=(stage, 1)):
        assert r["first"] is True
        for step in (1, 2):
            assert r[f"stepped_{step}"] is False and r[f"unchanged_{step}"]
        assert r["scales"] == [1024.0, 512.0, 256.0]  # halved by each overflow (hysteresis 1)
        assert r["recovered"] and r["moved_after"]
        assert r["skipped"] == 2 and r["global_steps"] == 2
        assert set(r["adam_steps"]) == {2}  # skipped steps never reached the optimizer


def test_default_hysteresis_lowers_scale_on_second_overflow():
    for r in run_distributed(_overflow, 2, args=(2, 2)):
        assert r["stepped_1"] is False and r["stepped_2"] is False
        assert r["scales"] == [1024.0, 1024.0, 512.0]  # DeepSpeed's hysteresis = 2
