"""ZeroAccelerator against plain Accelerate (DDP) in the same processes: the same custom loop
with accumulate(), clip_grad_norm_, a scheduler and gather_for_metrics gives the same model.
Also save_state/load_state, get_state_dict, and every configs/zero file."""

import pytest
import torch
import torch.distributed as dist
from helpers import ROOT, batch, build_model, max_param_diff, named_fp32

import hf_zero
from hf_zero.testing import run_distributed

STEPS, GAS, CLIP = 3, 2, 0.3


def _loop(accelerator, model) -> tuple[list[float], list[float]]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    losses, norms = [], []
    for step in range(STEPS * GAS):
        with accelerator.accumulate(model):
            x = batch(dist.get_rank(), step // GAS, step % GAS)
            loss = model(input_ids=x, labels=x).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), CLIP)))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        losses.append(accelerator.gather_for_metrics(loss.detach().reshape(1)).mean().item())
    return losses, norms, optimizer


def _accelerate_parity(stage: int, tmp: str) -> dict:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    ref_model = build_model()
    ref_losses, ref_norms, ref_optimizer = _loop(
        Accelerator(cpu=True, gradient_accumulation_steps=GAS), ref_model
    )
    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    model = build_model()
    accelerator = hf_zero.ZeroAccelerator(
        zero_plugin=hf_zero.ZeroPlugin(stage=stage, param_persistence_threshold=50),
        gradient_accumulation_steps=GAS,
    )
    losses, norms, optimizer = _loop(accelerator, model)
    out = {
        "param": max_param_diff(named_fp32(model), named_fp32(ref_model)),
        "loss": max(abs(a - b) / b for a, b in zip(losses, ref_losses)),
        "norm": max(abs(a - b) / b for a, b in zip(norms, ref_norms)),
        "lr": (optimizer.param_groups[0]["lr"], ref_optimizer.param_groups[0]["lr"]),
        "engine_stage": accelerator.engine.config.stage,
    }
    state = accelerator.get_state_dict(model)
    params = named_fp32(model)  # collective under ZeRO-3: every rank
    out["state_dict_ok"] = dist.get_rank() != 0 or all(
        torch.equal(state[k], v) for k, v in params.items()
    )
    # save_model: Hugging Face safetensors (streamed from the engine) holding the same values.
    accelerator.save_model(model, f"{tmp}/model")
    if dist.get_rank() == 0:
        from safetensors.torch import load_file

        written = load_file(f"{tmp}/model/model.safetensors")
        out["save_model_ok"] = bool(written) and all(
            torch.equal(written[k], state[k]) for k in written
        )
    # save_state -> train on -> load_state brings back the saved parameters exactly.
    accelerator.save_state(tmp)
    saved = named_fp32(model)
    x = batch(dist.get_rank(), 9, 0)
    accelerator.backward(model(input_ids=x, labels=x).loss)
    optimizer.step()
    moved = max_param_diff(named_fp32(model), saved)
    accelerator.load_state(tmp)
    out["moved"], out["restored"] = moved, max_param_diff(named_fp32(model), saved)
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_accelerator_matches_accelerate_ddp(stage, tmp_path):
    for r in run_distributed(_accelerate_parity, 2, args=(stage, str(tmp_path))):
        assert r["engine_stage"] == stage
        assert r["param"] <= 1e-6 and r["loss"] <= 1e-6, r
        assert r["norm"] <= 1e-6, "clip_grad_norm_ must return the pre-clip norm"
        # The scheduler advances as under plain Accelerate (which steps it once per process).
        assert r["lr"][0] == r["lr"][1] < 1e-3
        assert r["state_dict_ok"]
        assert r.get("save_model_ok", True)  # rank 0 reads the files back
        assert r["moved"] > 0 and r["restored"] == 0.0


def _config_file(name: str) -> dict:
    config = hf_zero.ZeroConfig.load(ROOT / "configs" / "zero" / name)
    model = build_model(vocab_size=250, intermediate_size=96)  # even sizes: autotp.yaml splits
    try:
        engine = hf_zero.initialize(
            model, torch.optim.AdamW(model.parameters(), lr=1e-2), config.replace(precision="fp32")
        )
    except NotImplementedError as error:
        return {"not_implemented": str(error)}
    losses = []
    for _ in range(4):
        x = batch(engine.topology.dp_rank, 0, 0)  # the same batch: the loss must fall
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    report = engine.memory_report()
    engine.close()  # NVMe files: removed now, not left to a rank the harness may kill at exit
    return {"losses": losses, "report": report, "stage": engine.config.stage}


@pytest.mark.parametrize(
    "name",
    sorted(p.name for p in (ROOT / "configs" / "zero").iterdir() if p.suffix in (".yaml", ".json")),
)
def test_every_zero_config_file_runs_or_says_why_not(name):
    for r in run_distributed(_config_file, 2, args=(name,)):
        assert r["losses"][-1] < r["losses"][0]
        if "nvme" in name:  # ZeRO-Infinity: model states in swap files, none in memory
            assert (
                r["report"]["nvme_optimizer_states"] > 0 and r["report"]["nvme_master_weights"] > 0
            )
            # fp32 parameter shards live in their masters' swap files (counted there once);
            # max_in_cpu 1e9 keeps a copy of each in host memory as well
            assert r["report"]["nvme_params"] == 0 and r["report"]["host_params"] > 0
            assert r["report"]["host_optimizer_states"] == r["report"]["host_master_weights"] == 0
            continue
        if "offload" in name:
            assert r["report"]["optimizer_states"] == 0 and r["report"]["host_optimizer_states"] > 0
            assert r["report"]["host_master_weights"] > 0
        # fp32 (as run here): the master weights are the parameters themselves, except offloaded
        assert r["report"]["master_weights"] == 0
        assert r["report"]["optimizer_states"] + r["report"]["host_optimizer_states"] > 0


def _tp_batches(tp_size: int) -> list[list[int]]:
    accelerator = hf_zero.ZeroAccelerator(zero_plugin=hf_zero.ZeroPlugin(tp_size=tp_size))
    loader = torch.utils.data.DataLoader(list(range(16)), batch_size=2)
    return [b.tolist() for b in accelerator.prepare(loader)]


def test_tensor_parallel_ranks_get_the_same_batches():
    """With tp_size = 2 the data is split over the data-parallel ranks (rank // 2) only."""
    tp2 = run_distributed(_tp_batches, 4, args=(2,))
    assert tp2[0] == tp2[1] and tp2[2] == tp2[3] and tp2[0] != tp2[2]
    assert sorted(x for b in tp2[0] + tp2[2] for x in b) == list(range(16))
    plain = run_distributed(_tp_batches, 4, args=(1,))
    assert len({str(b) for b in plain}) == 4  # without TP every rank has its own


def _pipeline_loop() -> dict:
    """A custom Accelerate loop with pp_size = 2 on 4 ranks (2 replicas): the engine's
    train_batch per step; backward is refused with what to call instead."""
    model = build_model(0, num_hidden_layers=4)
    accelerator = hf_zero.ZeroAccelerator(zero_plugin=hf_zero.ZeroPlugin(pp_size=2, stage=1))
    rows = torch.randint(0, 200, (8, 12), generator=torch.Generator().manual_seed(3)).repeat(2, 1)
    loader = torch.utils.data.DataLoader(rows, batch_size=4)
    model, optimizer, loader = accelerator.prepare(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), loader
    )
    seen, losses = [], []
    for ids in loader:
        seen.append(ids.tolist())
        losses.append(accelerator.engine.train_batch({"input_ids": ids}))
        optimizer.step()  # the loop's own calls have nothing left to do
        optimizer.zero_grad()
    try:
        accelerator.backward(torch.zeros((), requires_grad=True))
        refused = ""
    except RuntimeError as err:
        refused = str(err)
    return {"seen": seen, "losses": losses, "refused": refused,
            "norm": accelerator.clip_grad_norm_(model.parameters(), 1.0).item()}  # fmt: skip


def test_pipeline_stages_in_a_custom_accelerate_loop():
    r = run_distributed(_pipeline_loop, 4)
    # rank = pp_rank * 2 + dp_rank: ranks 0 and 2 (replica 0) see the same batches, 1 and 3
    assert r[0]["seen"] == r[2]["seen"] and r[1]["seen"] == r[3]["seen"] != r[0]["seen"]
    # Each replica sees its rows twice (the data repeats): training lowers the loss.
    assert r[0]["losses"] == r[2]["losses"] and r[0]["losses"][-1] < r[0]["losses"][0]
    assert "call accelerator.engine.train_batch(batch)" in r[0]["refused"]
    assert r[0]["norm"] > 0  # the norm train_batch measured


def _reference_model() -> dict:
    accelerator = hf_zero.ZeroAccelerator(
        zero_plugin=hf_zero.ZeroPlugin(stage=3, param_persistence_threshold=50)
    )
    model, reference, whole = build_model(), build_model(seed=1), build_model(seed=1)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    reference = accelerator.prepare_model(reference, evaluation_mode=True)
    engine = reference._hf_zero_engine
    held = engine.memory_report()
    out = {
        "training_engine_kept": accelerator.engine is model._hf_zero_engine,
        "frozen": not any(p.requires_grad for p in reference.parameters()),
        "visible": sum(p.numel() for p in reference.parameters()),
        "persistent": sum(p.numel() for p in whole.parameters() if p.numel() < 50),
        "total": sum(p.numel() for p in whole.parameters()),
        "params_bytes": held["params"],
        "trainable_state": held["grads"] + held["master_weights"] + held["optimizer_states"],
        "shard_bytes": sum(g.layout.shard_numel for g in engine.frozen_groups) * 4,
    }
    diffs = []
    for step in range(2):  # a DPO-like step: the reference's logits enter the loss
        x = batch(dist.get_rank(), step, 0)
        with torch.no_grad():
            ref_logits = reference(input_ids=x).logits
            diffs.append((ref_logits - whole(input_ids=x).logits).abs().max().item())
        loss = (
            model(input_ids=x, labels=x).loss
            + (model(input_ids=x).logits - ref_logits).square().mean()
        )
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    out["logit_diff"] = max(diffs)
    return out


def test_a_model_prepared_for_evaluation_is_sharded_without_training_state():
    """TRL's reference models (``prepare_model(..., evaluation_mode=True)``) under stage 3:
    each rank holds its shard of the weights (plus the small whole ones) and nothing else."""
    for r in run_distributed(_reference_model, 2):
        assert r["training_engine_kept"] and r["frozen"], r
        assert r["visible"] == r["persistent"], r  # every sharded weight released between uses
        sharded = r["total"] - r["persistent"]
        assert r["params_bytes"] == r["shard_bytes"] + 4 * r["persistent"], r
        assert 4 * sharded / 2 <= r["shard_bytes"] <= 4 * (sharded / 2 + 64 * 8), r  # + padding
        assert r["trainable_state"] == 0, r
        assert r["logit_diff"] == 0.0, r
