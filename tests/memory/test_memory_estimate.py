"""The formulas in hf_zero.memory against memory_report() measured on real ranks."""

import pytest
import torch
import torch.distributed as dist
from helpers import batch, build_model

import hf_zero
from hf_zero.memory import model_state_bytes
from hf_zero.testing import run_distributed


def _measure(stage: int, precision: str, offload: bool, offload_param: bool) -> dict:
    model = build_model()
    # No frozen parameters and nothing persistent, so P is every parameter.
    for p in model.parameters():
        p.requires_grad_(True)
    engine = hf_zero.initialize(
        model,
        torch.optim.AdamW(model.parameters()),
        stage=stage,
        precision=precision,
        offload_optimizer="cpu" if offload else "none",
        offload_param="cpu" if offload_param else "none",
        param_persistence_threshold=0,
    )
    x = batch(dist.get_rank(), 0, 0)
    engine.backward(engine(input_ids=x, labels=x).loss)
    engine.optimizer.prepare_grads()  # offload: the host gradient copy has landed
    after_backward = engine.memory_report()
    engine.step()
    after_step = engine.memory_report()
    state = engine.optimizer.optimizer.state
    steps = sum(s["step"].numel() * s["step"].element_size() for s in state.values())
    padded = sum(g.numel for g in engine.groups)
    return {
        "P": sum(p.numel() for p in model.parameters()),
        "padding": padded - sum(p.numel() for g in engine.groups for p in g.params),
        "grads": after_backward["grads"] + after_backward["host_grads"],
        "after": after_step,
        "steps": steps,
    }


@pytest.mark.parametrize(
    ("stage", "precision", "offload", "offload_param"),
    [(0, "bf16", False, False), (1, "bf16", False, False), (2, "bf16", False, False),
     (3, "bf16", False, False), (3, "fp32", False, False), (2, "bf16", True, False),
     (3, "bf16", True, False), (3, "fp32", False, True), (3, "bf16", True, True)],
)  # fmt: skip
def test_estimate_matches_measured_memory(stage, precision, offload, offload_param):
    for r in run_distributed(_measure, 2, args=(stage, precision, offload, offload_param)):
        estimate = model_state_bytes(
            r["P"], 2, stage, precision, offload, offload_param=offload_param
        )
        # Padding is the only difference: at most 8 x N elements per bucket, 16 bytes each.
        slack = 16 * r["padding"] + r["steps"]
        measured = dict(r["after"], grads=r["grads"], host_grads=0)
        kinds = ("params", "host_params", "master_weights", "optimizer_states")
        for kind in (*kinds, "host_master_weights"):
            assert abs(measured[kind] - estimate[kind]) <= slack, (kind, measured, estimate)
        expected_grads = estimate["grads"] + (4 * r["P"] / 2 if offload else 0)
        assert abs(r["grads"] - expected_grads) <= slack
        host = measured["host_optimizer_states"]
        assert abs(host - estimate["host_optimizer_states"]) <= slack


def _measure_whole_model(case: str) -> dict:
    """Per-rank bytes after backward (the model-state peak) for AutoTP, hpZ and MixZ++."""
    from hf_zero.memory import shape_of

    world = dist.get_world_size()
    if case == "mixz":
        from helpers import lora_model

        model = lora_model()
        trainable = [p for p in model.parameters() if p.requires_grad]
        cfg = dict(stage=3, quantized_nontrainable_weights=True)
    else:
        model = build_model(vocab_size=250, intermediate_size=96)
        for p in model.parameters():
            p.requires_grad_(True)
        trainable = list(model.parameters())
        cfg = dict(stage=1, tp_size=2) if case == "tp" else dict(stage=3, hpz_partition_size=2)
    shape = shape_of(model)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    engine = hf_zero.initialize(
        model, torch.optim.AdamW(trainable), precision="bf16", param_persistence_threshold=0, **cfg
    )
    x = batch(engine.topology.dp_rank, 0, 0, vocab=250)
    engine.backward(engine(input_ids=x, labels=x).loss)
    measured = engine.memory_report()
    padded = sum(g.numel for g in engine.groups + engine.frozen_groups)
    real = sum(p.numel() for g in engine.groups + engine.frozen_groups for p in g.params)
    return {
        "measured": measured,
        "shape": shape,
        "dp": engine.topology.dp_size,
        "frozen": frozen,
        "padding": padded - real,
        "world": world,
    }


@pytest.mark.parametrize(
    ("case", "world", "options"),
    [
        ("tp", 4, dict(stage=1, tp_size=2)),
        ("hpz", 4, dict(stage=3, hpz=2)),
        ("mixz", 2, dict(stage=3, mixz=True)),
    ],
)
def test_whole_model_estimate_matches_measured_memory(case, world, options):
    """`hf-zero estimate`'s numbers for AutoTP, hpZ and MixZ++ against memory_report()."""
    from hf_zero.memory import estimate

    for r in run_distributed(_measure_whole_model, world, args=(case,)):
        est = estimate(r["shape"], r["dp"], precision="bf16", frozen_params=r["frozen"], **options)
        slack = 18 * r["padding"] + 64  # padding elements at up to 18 bytes, step counters
        m = r["measured"]
        for kind in ("params", "master_weights", "secondary_params"):
            assert abs(m[kind] - est[kind]) <= slack, (kind, m[kind], est[kind])
        # Quantized shards: whole blocks of 256 (+ a scale each) per frozen group.
        assert abs(m["quantized_params"] - est.get("quantized_params", 0)) <= slack + 260 * 8
        if case == "tp":
            assert r["shape"].tp_split_params > 0.9 * r["shape"].params


def _measure_nvme(precision: str, offload_param: bool, folder: str, storage: dict) -> dict:
    model = build_model()
    for p in model.parameters():
        p.requires_grad_(True)
    engine = hf_zero.initialize(
        model,
        torch.optim.AdamW(model.parameters()),
        stage=3,
        precision=precision,
        offload_optimizer="nvme",
        offload_param="nvme" if offload_param else "none",
        nvme_path=folder,
        param_persistence_threshold=0,
        **storage,
    )
    x = batch(dist.get_rank(), 0, 0)
    engine.backward(engine(input_ids=x, labels=x).loss)
    engine.step()
    report = engine.memory_report()
    padded = sum(g.numel for g in engine.groups)  # the estimate's P: padding included
    engine.close()
    return {"report": report, "padded": padded, "groups": len(engine.groups)}


BF16_STORAGE = {"master_weights_dtype": "bf16", "optimizer_states_dtype": "bf16"}


@pytest.mark.parametrize(
    ("precision", "storage"), [("fp32", {}), ("bf16", {}), ("bf16", BF16_STORAGE)],
    ids=["fp32", "bf16", "bf16-16bit-storage"],
)  # fmt: skip
@pytest.mark.parametrize("offload_param", [False, True], ids=["optimizer", "opt+param"])
def test_infinity_estimate_matches_the_swap_files(tmp_path, precision, storage, offload_param):
    """``hf-zero estimate``'s NVMe rows (`infinity_bytes`) against the swap files a run made
    (with 16-bit storage: its ``+ bf16 master`` row)."""
    from hf_zero.memory import ModelShape, infinity_bytes

    args = (precision, offload_param, str(tmp_path), storage)
    for r in run_distributed(_measure_nvme, 2, args=args):
        shape = ModelShape(params=r["padded"])  # padding included
        in_16bit = {"optimizer_states_16bit": bool(storage), "master_weights_16bit": bool(storage)}
        estimate = infinity_bytes(shape, 2, precision, offload_param, **in_16bit)
        slack = 4096 * r["groups"]  # each swap file is padded to whole 4 KiB blocks
        for kind in ("nvme_params", "nvme_master_weights", "nvme_grads", "nvme_optimizer_states"):
            measured = r["report"][kind]
            assert 0 <= measured - estimate[kind] <= 2 * slack, (kind, measured, estimate)
        assert r["report"]["params"] <= estimate["params"] + slack
