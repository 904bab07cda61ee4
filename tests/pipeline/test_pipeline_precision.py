"""Pipeline stages in bf16 and fp16: 16-bit stages stepping fp32 master weights, against one
process doing the same by hand (a 16-bit model, an fp32 copy stepped; fp16: a loss scale), on the
same global batches as tests/pipeline/test_pipeline.py's fp32 cases. Then bf16 storage of what
the step keeps (``optimizer_states_dtype`` / ``master_weights_dtype: bf16``), the reference
rounding its own state and masters after each step."""

import torch
from helpers import MODEL, build_model
from test_pipeline import MICRO, _check_training, _data, _train

from hf_zero.testing import run_distributed


def test_bf16_stages_equal_bf16_training_with_fp32_master_weights():
    """bf16: the stages compute in bf16 and step fp32 master weights; the reference is one
    process doing the same by hand (a bf16 model, an fp32 copy stepped), each micro-batch's
    backward in turn as the schedule runs them. Untied, on one replica, the same arithmetic:
    losses and the saved model (the masters) equal bit for bit, the gradient norms to their
    summation order (1e-6)."""
    kwargs = {"stage": 0, "precision": "bf16"}
    results = run_distributed(_train, 2, args=(2, "1f1b", False), kwargs=kwargs)
    _check_training(results, pp=2, loss_tol=0.0, param_tol=0.0, norm_tol=1e-6)


def test_fp16_stages_scale_each_micro_batch_loss_and_equal_fp16_training():
    """fp16 with a fixed loss scale (1024): each micro-batch's backward in the schedule starts
    from the scaled loss, the step unscales into the fp32 masters; untied on one replica
    against one process doing so by hand: losses and masters equal bit for bit, the unscaled
    gradient norms to their summation order (1e-6)."""
    kwargs = {"stage": 0, "precision": "fp16", "loss_scale": 1024.0}
    results = run_distributed(_train, 2, args=(2, "1f1b", False), kwargs=kwargs)
    _check_training(results, pp=2, loss_tol=0.0, param_tol=0.0, norm_tol=1e-6)


def _overflowing(scale_power: int) -> dict:
    """One fp16 `train_batch` whose scaled gradients overflow, then one that does not."""
    import hf_zero

    model = build_model(0, num_hidden_layers=4)
    engine = hf_zero.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), pp_size=2, pp_microbatches=MICRO,
        precision="fp16", initial_scale_power=scale_power, hysteresis=1,
    )  # fmt: skip
    ids, mask, labels = _data()
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    before = {id(p): p.detach().clone() for p in engine.stage_parameters()}
    out = {"scale": engine.loss_scale, "loss": engine.train_batch(batch)}
    out["skipped"], out["steps"] = engine.last_step_skipped, engine.global_steps
    out["unchanged"] = all(torch.equal(p, before[id(p)]) for p in engine.stage_parameters())
    out["scale_after"] = engine.loss_scale
    for _ in range(40):  # the scale halves on each overflow until a step goes through
        engine.train_batch(batch)
        if not engine.last_step_skipped:
            break
    out["then_stepped"] = not engine.last_step_skipped
    out["skipped_steps"], out["steps_after"] = engine.skipped_steps, engine.global_steps
    return out


def test_an_fp16_overflow_skips_the_step_on_every_stage():
    """A scale of 2^40 overflows fp16 gradients on some stage: every stage skips the step
    (parameters unchanged, no step counted), the scale halves (hysteresis 1), the reported loss
    is the unscaled one; a smaller scale then steps."""
    results = run_distributed(_overflowing, 2, args=(40,))
    for r in results:
        assert r["skipped"] and r["steps"] == 0 and r["unchanged"], r
        assert r["scale_after"] == r["scale"] / 2 == 2.0**39, r
        assert 1.0 < r["loss"] < 10.0, r  # the mean micro-batch loss, not scaled
        assert r["then_stepped"] and r["steps_after"] == 1, r
    assert len({(r["skipped_steps"], r["scale_after"]) for r in results}) == 1, results


def test_bf16_stages_times_two_replicas_zero_2_tied():
    """PP 2 x DP 2, ZeRO-2, bf16, tied embeddings: within `BF16_TOL` of the same reference;
    each rank holds its stage's parameters in bf16 and its shard of fp32 master weights, as
    `hf-zero estimate`'s formula says (up to each bucket's padding)."""
    from hf_zero.memory import model_state_bytes

    kwargs = {"stage": 2, "precision": "bf16"}
    results = run_distributed(_train, 4, args=(2, "1f1b", True), kwargs=kwargs)
    _check_training(results, pp=2, dp=2, param_tol=BF16_TOL, loss_tol=BF16_TOL, relative=True,
                    norm_tol=BF16_TOL)  # fmt: skip
    for r in results:
        memory, pad = r["memory"], 16 * r["buckets"]
        formula = model_state_bytes(r["stage_numel"], 2, 2, "bf16")
        frozen = 2 * MODEL["hidden_size"]  # one norm weight, frozen by build_model
        assert formula["params"] <= memory["params"] <= formula["params"] + frozen + 2 * pad
        master = formula["master_weights"]
        assert master <= memory["master_weights"] <= master + 4 * pad, (memory, formula)


BF16_TOL = 2e-2
"""PP 2 x DP 2 in bf16 with tied embeddings against the one-process reference, losses and the
fp32 master weights norm-wise relative (untied and on one replica the two are equal, the test
above). Two sums are rounded to bf16 at other points than the reference's: the tied weight's two
copies' gradients, added across the first and last stage where one process accumulates both
into one ``.grad``, and the replicas' gradients, summed by the collective where the reference
adds them in Python. How far that carries depends on the CPU's bf16 kernels; measured after 3
steps: 5.6e-3 in the masters with AVX-512 bf16 kernels, 1.1e-2 with AVX2 ones (oneDNN and ATen
limited to AVX2, as on a CPU without bf16 instructions); 1e-3 in the losses."""


STORAGE_16BIT = {"master_weights_dtype": "bf16", "optimizer_states_dtype": "bf16"}


def test_bf16_optimizer_states_in_stages_equal_the_reference_bit_for_bit():
    """``optimizer_states_dtype: bf16`` inside stages: Adam's moments kept in bf16 between
    steps (widened for each step), the reference narrowing its own moments the same way after
    each step; untied PP 2: losses and fp32 masters equal bit for bit,
    and each rank holds 2 bytes per moment (up to padding)."""
    kwargs = {"stage": 0, "precision": "bf16", "optimizer_states_dtype": "bf16"}
    results = run_distributed(_train, 2, args=(2, "1f1b", False), kwargs=kwargs)
    _check_training(results, pp=2, loss_tol=0.0, param_tol=0.0, norm_tol=1e-6)
    for r in results:
        moments = 2 * 2 * r["stage_numel"]  # exp_avg and exp_avg_sq, 2 bytes each
        assert moments <= r["memory"]["optimizer_states"] <= moments + 4 * 16 * r["buckets"], r


def test_bf16_master_weights_in_stages_round_the_step_stochastically():
    """``master_weights_dtype: bf16`` inside stages: no fp32 copy is kept (the bf16 parameters
    are the master); one step against the reference's fp32 update of the
    same bf16 values. The losses are equal, and every stepped weight is one of the two bf16 values
    next to the reference's fp32 result (stochastic rounding: some round away from the nearest,
    measured: 23% of elements)."""
    kwargs = {"stage": 0, "precision": "bf16", "steps": 1, **STORAGE_16BIT}
    results = run_distributed(_train, 2, args=(2, "1f1b", False), kwargs=kwargs)
    # The masters are checked below, element by element.
    _check_training(results, pp=2, loss_tol=0.0, param_tol=float("inf"), norm_tol=1e-6)
    for r in results:
        assert r["memory"]["master_weights"] == 0, r["memory"]
    saved, unrounded = results[0]["saved"], results[0]["unrounded"]
    assert sorted(saved) == sorted(unrounded)
    away = total = 0
    for name, value in saved.items():
        exact = unrounded[name]
        down = (exact.view(torch.int32) & -65536).view(torch.float32)  # toward zero
        up = ((exact.view(torch.int32) & -65536) + 65536).view(torch.float32)
        assert bool(((value == down) | (value == up)).all()), name
        away += int((value != exact.to(torch.bfloat16).float()).sum())
        total += value.numel()
    assert 0.05 < away / total < 0.5, (away, total)


def test_bf16_storage_in_stages_times_two_replicas_zero_1_tied():
    """PP 2 x DP 2, ZeRO-1, tied embeddings, bf16 master weights and optimizer state, three
    steps: within `STORAGE_TOL` of the reference (which rounds its masters to nearest, the
    engine stochastically); the tied weight's two copies, rounded in different groups, are
    equal after every step (the first stage sends its values); each rank holds what
    `hf-zero estimate`'s 16-bit storage formula says (no master copy, 2-byte moments), up to
    padding."""
    from hf_zero.memory import model_state_bytes

    kwargs = {"stage": 1, "precision": "bf16", **STORAGE_16BIT}
    results = run_distributed(_train, 4, args=(2, "1f1b", True), kwargs=kwargs)
    _check_training(results, pp=2, dp=2, param_tol=STORAGE_TOL, loss_tol=BF16_TOL,
                    relative=True, norm_tol=BF16_TOL)  # fmt: skip
    for dp_rank in range(2):  # ranks (pp, dp): (0, d) holds the embedding, (1, d) its copy
        first, last = results[dp_rank]["tied_weight"], results[2 + dp_rank]["tied_weight"]
        assert first is not None and torch.equal(first, last), dp_rank
    for r in results:
        memory, pad = r["memory"], 16 * r["buckets"]
        formula = model_state_bytes(r["stage_numel"], 2, 1, "bf16", storage_16bit=True)
        assert memory["master_weights"] == formula["master_weights"] == 0, memory
        states = formula["optimizer_states"]
        assert states <= memory["optimizer_states"] <= states + 4 * pad, (memory, formula)


STORAGE_TOL = 3e-2
"""bf16 master weights, PP 2 x DP 2 tied, against the reference, norm-wise relative: the two
bf16 sums of `BF16_TOL` plus the rounding itself, which differs from the reference's nearest by
one bf16 step (2^-8 relative) in about a quarter of the elements each step. Measured after 3
steps: 9.3e-3 in the masters with AVX-512 bf16 kernels, 1.6e-2 with AVX2 ones; 1e-3 in the
losses."""
