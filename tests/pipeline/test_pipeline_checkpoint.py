"""Pipeline checkpoints: resume at the same layout bit for bit, load at another
``pp_size`` / data-parallel size / ZeRO stage, refuse another ``tp_size`` clearly, survive a
failed save, and consolidate to one ``model.safetensors``.

Every run trains on the same global batches with micro-batches of 2 samples (so the objective,
a mean of micro-batch losses, is the same whatever the layout): replica ``d`` takes the ``d``-th
slice of each global batch.
"""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import build_model
from safetensors.torch import load_file
from test_pipeline import ADAM_EPS, _data, lm_loss

import hf_zero
from hf_zero.testing import run_distributed

GLOBAL, MICRO_SIZE = 16, 2


def _engine(pp: int, **cfg):
    model = build_model(0, num_hidden_layers=4)
    dp = dist.get_world_size() // pp
    return hf_zero.initialize(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2, eps=ADAM_EPS),
        pp_size=pp,
        pp_microbatches=GLOBAL // dp // MICRO_SIZE,
        gradient_clipping=0.5,
        **cfg,
    )


def _steps(engine, first: int, count: int) -> list[float]:
    """Mean loss over the global batch for steps ``first .. first + count - 1``."""
    ids, mask, labels = _data(2)
    topo = engine.topology
    per = GLOBAL // topo.dp_size
    mine = slice(topo.dp_rank * per, (topo.dp_rank + 1) * per)
    losses = []
    for step in range(first, first + count):
        batch = {"input_ids": ids.roll(step, 0), "attention_mask": mask.roll(step, 0),
                 "labels": labels.roll(step, 0)}  # fmt: skip
        loss = torch.tensor([engine.train_batch({k: v[mine] for k, v in batch.items()})])
        dist.all_reduce(loss)  # every replica's mean, averaged: the global batch's loss
        losses.append(loss.item() / dist.get_world_size())
    return losses


def _save_then_continue(path: str, pp: int, stage: int, **cfg) -> dict:
    engine = _engine(pp, stage=stage, **cfg)
    _steps(engine, 0, 2)
    engine.save_checkpoint(path)
    after = _steps(engine, 2, 2)
    return {"after": after, "full": engine.full_state_dict()}


def _load_and_continue(path: str, pp: int, stage: int, **cfg) -> dict:
    engine = _engine(pp, stage=stage, **cfg)
    engine.load_checkpoint(path)
    assert engine.global_steps == 2
    return {"after": _steps(engine, 2, 2)}


@pytest.mark.slow
def test_resume_same_layout_bit_exact_and_resharded_to_other_layouts(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = run_distributed(_save_then_continue, 2, args=(path, 2, 1))[0]
    same = run_distributed(_load_and_continue, 2, args=(path, 2, 1))[0]
    assert same["after"] == saved["after"]  # the same layout: bit for bit
    # Another layout runs the same arithmetic in another order: equal to the parity tolerance.
    # The last layout steps its optimizer in host memory (ZeRO-Offload): loaded into it.
    for world, pp, stage, cfg in [(4, 4, 0, {}), (4, 2, 2, {"offload_optimizer": "cpu"})]:
        other = run_distributed(_load_and_continue, world, args=(path, pp, stage), kwargs=cfg)[0]
        assert max(abs(a - b) for a, b in zip(other["after"], saved["after"])) <= 1e-6, other

    # hf-zero consolidate: the whole model under its own names, as the run holds it.
    out = tmp_path / "consolidated"
    from hf_zero.cli import main

    assert main(["consolidate", path, str(out)]) == 0
    written = load_file(str(out / "model.safetensors"))
    model = build_model(0, num_hidden_layers=4)  # for its parameter names
    assert sorted(written) == sorted(n for n, _ in model.named_parameters())
    reference = run_distributed(_full_after_load, 2, args=(path,))[0]
    for name, value in written.items():
        assert torch.equal(value, reference[name]), name


def test_bf16_stages_save_their_fp32_master_weights_and_resume_bit_exact(tmp_path):
    """A bf16 run's checkpoint holds the fp32 master weights, not the bf16 parameters: the
    resume continues bit for bit (rebuilding the masters from bf16 values would not)."""
    path = str(tmp_path / "ckpt")
    bf16 = {"precision": "bf16"}
    saved = run_distributed(_save_then_continue, 2, args=(path, 2, 1), kwargs=bf16)[0]
    same = run_distributed(_load_and_continue, 2, args=(path, 2, 1), kwargs=bf16)[0]
    assert same["after"] == saved["after"]
    written = load_file(str(Path(path) / "stage_pp00_tp00.safetensors"))
    value = written["param/model.layers.0.self_attn.q_proj.weight"]
    assert value.dtype == torch.float32
    assert not torch.equal(value, value.bfloat16().float())  # not a bf16 value widened


def test_bf16_storage_stages_resume_bit_exact(tmp_path):
    """bf16 master weights and optimizer state inside stages (tied): the checkpoint holds the
    bf16 masters and moments, widened (a pipeline checkpoint's tensors are fp32); the resume
    rounds its steps with the same seeds, so it continues bit for bit."""
    path = str(tmp_path / "ckpt")
    cfg = {"precision": "bf16", "master_weights_dtype": "bf16", "optimizer_states_dtype": "bf16"}
    saved = run_distributed(_save_then_continue, 2, args=(path, 2, 1), kwargs=cfg)[0]
    same = run_distributed(_load_and_continue, 2, args=(path, 2, 1), kwargs=cfg)[0]
    assert same["after"] == saved["after"]
    written = load_file(str(Path(path) / "stage_pp00_tp00.safetensors"))
    value = written["param/model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(value, value.bfloat16().float())  # the master is the bf16 parameter
    moments = [v for k, v in written.items() if k.startswith("state/") and "exp_avg" in k]
    assert moments and all(torch.equal(v, v.bfloat16().float()) for v in moments)


FP16 = {"precision": "fp16", "initial_scale_power": 20, "hysteresis": 1}
"""A dynamic loss scale that starts too high for this model: the first steps overflow."""


def _fp16_save_then_continue(path: str) -> dict:
    engine = _engine(2, stage=1, **FP16)
    _steps(engine, 0, 6)
    saved = (engine.loss_scale, engine.global_steps, engine.skipped_steps)
    engine.save_checkpoint(path)
    return {"saved": saved, "after": _steps(engine, 6, 2)}


def _fp16_load_and_continue(path: str, precision: str = "fp16") -> dict:
    engine = _engine(2, stage=1, **{**FP16, "precision": precision})
    engine.load_checkpoint(path)
    return {"loaded": (engine.loss_scale, engine.global_steps), "after": _steps(engine, 6, 2)}


def test_fp16_stages_resume_with_their_loss_scale_bit_exact(tmp_path):
    """fp16 stages: the dynamic loss scale (lowered by the first steps' overflows) is saved and
    restored with the step counter, and the resume continues bit for bit."""
    path = str(tmp_path / "ckpt")
    saved = run_distributed(_fp16_save_then_continue, 2, args=(path,))[0]
    scale, steps, skipped = saved["saved"]
    assert scale < 2.0**20 and skipped > 0 and steps > 0, saved  # the case is exercised
    loaded = run_distributed(_fp16_load_and_continue, 2, args=(path,))[0]
    assert loaded["loaded"] == (scale, steps)
    assert loaded["after"] == saved["after"]
    # Resumed in bf16, the run does not scale its loss, whatever the fp16 run had reached.
    bf16 = run_distributed(_fp16_load_and_continue, 2, args=(path, "bf16"))[0]
    assert bf16["loaded"] == (1.0, steps)


def _full_after_load(path: str) -> dict:
    engine = _engine(2, stage=1)
    engine.load_checkpoint(path)
    return engine.full_state_dict()


def _refusals(path: str) -> dict:
    engine = _engine(2, stage=0, tp_size=1)
    out = {}
    try:
        engine.load_checkpoint(path + "-missing")
    except ValueError as err:
        out["missing"] = str(err)
    return out


def _save_twice_second_fails(path: str) -> dict:
    import hf_zero.engine.pipeline_checkpointing as ckpt

    engine = _engine(2, stage=2)
    _steps(engine, 0, 1)
    engine.save_checkpoint(path)
    first = engine.full_state_dict()
    _steps(engine, 1, 1)
    real = ckpt.write_streamed

    def broken(pieces, filename, metadata=None):
        for _, produce in pieces[:2]:  # the loose parameters, then the first group
            produce()
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full (simulated)")

    ckpt.write_streamed = broken
    error = None
    try:
        engine.save_checkpoint(path)
    except OSError as err:
        error = str(err)
    finally:
        ckpt.write_streamed = real
    dist.barrier()
    fresh = _engine(2, stage=2)
    fresh.load_checkpoint(path)
    left = sorted(p.name for p in Path(path).parent.iterdir())
    return {"first": first, "loaded": fresh.full_state_dict(), "steps": fresh.global_steps,
            "error": error, "left": left}  # fmt: skip


def test_a_failed_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    """PP 2 x DP 2 under ZeRO-2: a stage's first replica fails to write its file after the first
    group; its replica, which all-gathers the state shards with it, is not left waiting, every
    rank raises, the partial save is removed and the previous checkpoint loads as it was."""
    results = run_distributed(_save_twice_second_fails, 4, args=(str(tmp_path / "ckpt"),))
    for r in results:
        assert r["error"] is not None and "saving" in r["error"], r["error"]
    r = results[0]
    assert "disk full (simulated)" in r["error"], r["error"]
    assert r["steps"] == 1 and r["left"] == ["ckpt"], r["left"]
    assert all(torch.equal(r["first"][n], r["loaded"][n]) for n in r["first"])


def _load_error(engine, path: str) -> str:
    """What loading ``path`` into ``engine`` raised, or "accepted"."""
    try:
        engine.load_checkpoint(path)
    except ValueError as err:
        return str(err)
    return "accepted"


def _load(path: str) -> str:
    return _load_error(_engine(2), path)


def _save_with_nan(path: str) -> None:
    """A checkpoint whose bytes are intact but whose values are not: a NaN in a parameter."""
    engine = _engine(2)
    _steps(engine, 0, 1)
    with torch.no_grad():
        engine.stage_parameters()[0].view(-1)[0] = float("nan")
    engine.save_checkpoint(path)


def test_a_changed_byte_a_cut_file_or_a_nan_in_a_stage_file_is_refused(tmp_path):
    """Every tensor of a stage file carries CRC-32s: one byte changed in the data, or a file cut
    short, is found on load, on every rank, before anything is resumed; so is a NaN that a
    run saved."""
    path = tmp_path / "ckpt"
    run_distributed(_save_then_continue, 2, args=(str(path), 2, 1))
    assert run_distributed(_load, 2, args=(str(path),)) == ["accepted"] * 2
    stage = path / "stage_pp01_tp00.safetensors"
    data = stage.read_bytes()
    changed = bytearray(data)
    changed[-5] ^= 0x01
    stage.write_bytes(bytes(changed))
    msgs = run_distributed(_load, 2, args=(str(path),))
    assert "checksum mismatch" in msgs[1] and "stage_pp01_tp00" in msgs[1], msgs
    assert "failed to load on another rank" in msgs[0], msgs
    stage.write_bytes(data[:-64])
    msgs = run_distributed(_load, 2, args=(str(path),))
    assert "is truncated" in msgs[1] and "failed to load on another rank" in msgs[0], msgs
    nan = tmp_path / "nan"
    run_distributed(_save_with_nan, 2, args=(str(nan),))
    msgs = run_distributed(_load, 2, args=(str(nan),))
    assert all("holds NaN/Inf" in m or "another rank" in m for m in msgs), msgs
    assert any("holds NaN/Inf" in m for m in msgs), msgs


def test_missing_and_mismatched_checkpoints_are_refused_clearly(tmp_path):
    msg = run_distributed(_refusals, 2, args=(str(tmp_path / "none"),))[0]["missing"]
    assert "is not a complete pipeline checkpoint" in msg
    meta = tmp_path / "ck"
    run_distributed(_save_then_continue, 2, args=(str(meta), 2, 0))
    msgs = run_distributed(_tp_mismatch, 4, args=(str(meta),))
    assert "saved with 'tp_size' = 1; this run has tp_size 2" in msgs[0]


def _tp_mismatch(path: str) -> str:
    model = build_model(0, num_hidden_layers=4, vocab_size=256)
    engine = hf_zero.initialize(
        model, torch.optim.AdamW(model.parameters()), pp_size=2, tp_size=2, pp_microbatches=2
    )
    return _load_error(engine, path)


def test_eval_loss_matches_the_model_after_loading(tmp_path):
    """The loaded stages compute what the consolidated model computes."""
    path = str(tmp_path / "ckpt")
    run_distributed(_save_then_continue, 2, args=(path, 2, 2))
    from hf_zero.checkpoint.consolidate import consolidate

    consolidate(path, tmp_path / "out")
    model = build_model(0, num_hidden_layers=4)
    model.load_state_dict(load_file(str(tmp_path / "out" / "model.safetensors")), strict=False)
    ids, mask, labels = _data(2)
    with torch.no_grad():
        chunks = zip(*(t.chunk(GLOBAL // MICRO_SIZE) for t in (ids, mask, labels)))
        want = sum(lm_loss(model(input_ids=i, attention_mask=m).logits, t) for i, m, t in chunks)
    got = run_distributed(_eval_after_load, 2, args=(path,))[0]
    assert abs(got - want.item() / (GLOBAL // MICRO_SIZE)) <= 1e-5


def _eval_after_load(path: str) -> float:
    engine = _engine(2)
    engine.load_checkpoint(path)
    ids, mask, labels = _data(2)
    return engine.eval_batch({"input_ids": ids, "attention_mask": mask, "labels": labels})


def _trainer_evaluate(tmp: str) -> dict:
    from transformers import default_data_collator

    from hf_zero import ZeroTrainer, ZeroTrainingArguments

    args = ZeroTrainingArguments(
        output_dir=tmp, pp_size=2, zero_stage=1, max_steps=2, per_device_train_batch_size=2,
        gradient_accumulation_steps=2, per_device_eval_batch_size=4, report_to="none",
        save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    ids, mask, labels = _data(2)
    data = [
        {"input_ids": i, "attention_mask": m, "labels": t} for i, m, t in zip(ids, mask, labels)
    ]
    trainer = ZeroTrainer(
        model=build_model(0, num_hidden_layers=4), args=args, train_dataset=data,
        eval_dataset=data[:8], data_collator=default_data_collator,
    )  # fmt: skip
    trainer.train()
    metrics = trainer.evaluate()  # through the stages (prediction_step -> eval_batch)
    model = trainer.model  # whole again on every rank after train()
    with torch.no_grad():
        want = [
            lm_loss(model(input_ids=i, attention_mask=m).logits, t).item()
            for i, m, t in zip(*(t[:8].chunk(2) for t in (ids, mask, labels)))
        ]
    return {"eval_loss": metrics["eval_loss"], "want": sum(want) / len(want)}


def test_trainer_evaluates_through_the_stages(tmp_path):
    """``trainer.evaluate()`` with pp_size = 2: each eval batch runs as one micro-batch through
    the stages; the loss equals the whole model's on the same batches (which every rank holds
    again after train())."""
    for r in run_distributed(_trainer_evaluate, 2, args=(str(tmp_path),)):
        assert abs(r["eval_loss"] - r["want"]) <= 1e-5, r
