"""DeepSpeed `optimizer` / `scheduler` sections where users meet them: ZeroTrainer following a
DeepSpeed JSON, ZeroAccelerator honouring the config's gradient_accumulation_steps and
gradient_clipping, and the bare engine building the schedule as ``deepspeed.initialize`` does.
The schedules' formulas themselves are checked in test_ds_schedules.py."""

import json
import logging

import pytest
import torch
import torch.distributed as dist
from helpers import batch, build_model, max_param_diff, named_fp32
from test_ds_schedules import ds_warmup_decay_lr

from hf_zero import ZeroConfig
from hf_zero.optim.deepspeed_schedules import WarmupDecayLR, build_scheduler, scheduler_from_config
from hf_zero.testing import run_distributed

# --- ZeroTrainer with a DeepSpeed JSON --------------------------------------------------------
DS_JSON = {
    "zero_optimization": {"stage": 2},
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 1e-4, "betas": "auto", "eps": "auto", "weight_decay": 0.01},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": 1e-4,
            "warmup_num_steps": 3,
            "total_num_steps": "auto",
        },
    },
}
TRAINER_STEPS = 8


def _trainer_run(tmp: str) -> dict:
    from transformers import default_data_collator

    from hf_zero import ZeroTrainer, ZeroTrainingArguments

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append((record.levelname, record.getMessage()))
    log = logging.getLogger("hf_zero.integrations.trainer")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    with open(f"{tmp}/ds.json", "w") as f:
        json.dump(DS_JSON, f)
    args = ZeroTrainingArguments(
        output_dir=tmp, zero_config=f"{tmp}/ds.json", max_steps=TRAINER_STEPS,
        per_device_train_batch_size=2, gradient_accumulation_steps=2, logging_steps=1,
        adam_beta2=0.98, report_to="none", save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    data = [{"input_ids": x, "labels": x} for x in batch(0, 0, 0).repeat(16, 1)]
    trainer = ZeroTrainer(
        model=build_model(), args=args, train_dataset=data, data_collator=default_data_collator
    )
    trainer.train()
    inner = trainer.optimizer.optimizer
    out = {
        "lrs": [h["learning_rate"] for h in trainer.state.log_history if "loss" in h],
        "optimizer": type(inner).__name__,
        "groups": [(g["weight_decay"], g["betas"], g["eps"]) for g in inner.param_groups],
        "engine_gas": trainer.engine.config.gradient_accumulation_steps,
        "engine_clip": trainer.engine.config.gradient_clipping,
    }
    # An optimizer passed to the Trainer wins over the section, with a warning; the scheduler
    # section still applies to it.
    mine = torch.optim.SGD(build_model().parameters(), lr=0.1)
    other = ZeroTrainer(model=build_model(), args=args, train_dataset=data, optimizers=(mine, None))
    out["kept"] = other.create_optimizer() is mine
    out["scheduler_on_it"] = type(other.create_scheduler(10)).__name__
    out["records"] = records
    return out


def test_zero_trainer_follows_the_json_optimizer_and_schedule(tmp_path):
    (r,) = run_distributed(_trainer_run, 1, args=(str(tmp_path),))
    want = [ds_warmup_decay_lr(k - 2, TRAINER_STEPS, 0.0, 1e-4, 3) for k in range(1, 9)]
    assert r["lrs"] == pytest.approx(want, rel=1e-9, abs=1e-15), r["lrs"]
    assert r["optimizer"] == "AdamW"
    # The Trainer's decay / no-decay groups; betas and eps "auto" from the arguments.
    assert r["groups"] == [(0.01, (0.9, 0.98), 1e-8), (0.0, (0.9, 0.98), 1e-8)]
    assert (r["engine_gas"], r["engine_clip"]) == (1, 0.0)  # the Trainer accumulates and clips
    messages = "\n".join(m for _, m in r["records"])
    assert "optimizer AdamW" in messages and "scheduler WarmupDecayLR" in messages
    assert "optimizer.params.lr = 0.0001 (Trainer: 5e-05)" in messages
    assert r["kept"] and r["scheduler_on_it"] == "WarmupDecayLR"
    assert "'optimizer' section is overridden by the optimizer passed" in messages


# --- ZeroAccelerator: accumulation and clipping from the config ------------------------------
ACC_STEPS, ACC_GAS, ACC_CLIP, WORLD = 4, 2, 0.05, 2
ACC_CONFIG = {
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 4000},
    "train_batch_size": 2 * ACC_GAS * WORLD,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": ACC_GAS,
    "gradient_clipping": ACC_CLIP,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 2, "total_num_steps": "auto", "warmup_max_lr": "auto"}},
}  # fmt: skip


def _reference(clip: float) -> tuple[dict, list, list]:
    """A plain torch loop on one process over every rank's batches (what DDP averages)."""
    from hf_zero.optim.deepspeed_optimizer import optimizer_from_config

    config = ZeroConfig.load(ACC_CONFIG)
    model = build_model()
    opt = optimizer_from_config([p for p in model.parameters() if p.requires_grad], config)
    scheduler = scheduler_from_config(opt, config, ACC_STEPS)
    lrs, norms = [], []
    for step in range(ACC_STEPS):
        for micro in range(ACC_GAS):
            xs = [batch(r, step, micro) for r in range(WORLD)]
            loss = sum(model(input_ids=x, labels=x).loss for x in xs) / WORLD
            (loss / ACC_GAS).backward()
        params = [p for p in model.parameters() if p.requires_grad]
        norms.append(torch.nn.utils.clip_grad_norm_(params, clip).item())
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
        opt.zero_grad()
    return named_fp32(model), lrs, norms


def _accelerate_run(user_clip: float | None) -> dict:
    import hf_zero
    from hf_zero.optim.deepspeed_optimizer import optimizer_from_config

    accelerator = hf_zero.ZeroAccelerator(zero_plugin=hf_zero.ZeroPlugin(ACC_CONFIG))
    config = accelerator.zero_plugin.config
    model = build_model()
    opt = optimizer_from_config([p for p in model.parameters() if p.requires_grad], config)
    scheduler = scheduler_from_config(opt, config, ACC_STEPS)
    model, opt, scheduler = accelerator.prepare(model, opt, scheduler)
    lrs, norms, rank = [], [], dist.get_rank()
    for step in range(ACC_STEPS):
        for micro in range(ACC_GAS):
            with accelerator.accumulate(model):
                x = batch(rank, step, micro)
                accelerator.backward(model(input_ids=x, labels=x).loss)
                if accelerator.sync_gradients:
                    lrs.append(opt.param_groups[0]["lr"])
                    if user_clip is not None:
                        accelerator.clip_grad_norm_(model.parameters(), user_clip)
                opt.step()
                scheduler.step()
                opt.zero_grad()
        norms.append(accelerator.engine.grad_norm)
    ref_params, ref_lrs, ref_norms = _reference(ACC_CLIP if user_clip is None else user_clip)
    return {
        "gas": accelerator.gradient_accumulation_steps,
        "param": max_param_diff(named_fp32(model), ref_params),
        "lrs": (lrs, ref_lrs),
        "norms": (norms, ref_norms),
        "post_clip": accelerator.engine.grad_norm_post_clip,
    }


@pytest.mark.parametrize("user_clip", [None, 0.2])
def test_zero_accelerator_honours_the_config_accumulation_and_clipping(user_clip):
    """The config's accumulation and clipping apply; a clip_grad_norm_ call of the loop's own
    replaces the config's clipping for that step (clipped once, to the loop's value)."""
    for r in run_distributed(_accelerate_run, WORLD, args=(user_clip,)):
        assert r["gas"] == ACC_GAS
        assert r["param"] <= 1e-6, r
        assert r["lrs"][0] == pytest.approx(r["lrs"][1], rel=1e-12)  # once per optimizer step
        assert r["norms"][0] == pytest.approx(r["norms"][1], rel=1e-5)
        clip = ACC_CLIP if user_clip is None else user_clip
        assert min(r["norms"][1]) > clip and r["post_clip"] == pytest.approx(clip, rel=1e-4)


def test_zero_accelerator_refuses_a_different_accumulation():
    import hf_zero

    plugin = hf_zero.ZeroPlugin(gradient_accumulation_steps=4)
    with pytest.raises(
        ValueError, match=r"gradient_accumulation_steps = 4.*given gradient_accumulation_steps = 3"
    ):
        hf_zero.ZeroAccelerator(zero_plugin=plugin, gradient_accumulation_steps=3)


def test_bare_engine_builds_the_config_schedule_as_deepspeed_initialize_does():
    """`hf_zero.initialize(model, None, ds_config)`: optimizer and schedule from the sections,
    the schedule stepped once per optimizer step (its formula is tested above)."""
    import hf_zero
    from hf_zero.tiny import tiny_llama

    section = {
        "type": "WarmupDecayLR",
        "params": {"warmup_max_lr": 1e-3, "warmup_num_steps": 2, "total_num_steps": 4},
    }
    ds = {
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "scheduler": section,
    }
    model = tiny_llama()
    try:
        engine = hf_zero.initialize(model, None, ds)
        reference = build_scheduler(torch.optim.SGD([torch.zeros(1)], lr=1e-3), section)
        assert isinstance(engine.lr_scheduler, WarmupDecayLR)
        for _ in range(4):
            loss = model(input_ids=torch.randint(0, 256, (1, 8))).logits.float().mean()
            engine.backward(loss)
            engine.step()
            reference.step()
            assert engine.optimizer.optimizer.param_groups[0]["lr"] == reference.get_last_lr()[0]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
