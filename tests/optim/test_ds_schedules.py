"""DeepSpeed `optimizer` / `scheduler` sections: every schedule's learning rate, step by step,
against DeepSpeed's formulas (written out here from deepspeed/runtime/lr_schedules.py and its
docs); "auto" filling; errors. Their use under the Trainer, Accelerate and the bare engine is
in test_ds_sections.py."""

import json
import logging
import math

import pytest
import torch
import torch.distributed as dist

from hf_zero import ZeroConfig
from hf_zero.optim.deepspeed_optimizer import build_optimizer, optimizer_spec, trainer_values
from hf_zero.optim.deepspeed_schedules import (
    OneCycle,
    WarmupCosineLR,
    build_scheduler,
    scheduler_from_config,
)


# --- DeepSpeed's formulas, by DeepSpeed's iteration i (-1 before the first scheduler step) ----
def warmup_fraction(i, warmup, kind):
    w = max(2, warmup)  # DeepSpeed warms up over at least 2 steps
    return math.log(i + 1) / math.log(w) if kind == "log" else i / w


def ds_warmup_lr(i, lo=0.0, hi=0.001, warmup=1000, kind="log"):
    if i < 0:
        return lo
    if i >= max(2, warmup):
        return hi
    return lo + (hi - lo) * warmup_fraction(i, warmup, kind)


def ds_warmup_decay_lr(i, total, lo=0.0, hi=0.001, warmup=1000, kind="log"):
    w = max(2, warmup)
    if i < w:
        return ds_warmup_lr(i, lo, hi, warmup, kind)
    return lo + (hi - lo) * max(0.0, (total - i) / max(1, total - w))


def ds_warmup_cosine_lr(i, base, total, min_ratio=0.0, warmup=1000, cos_min=1e-4, kind="log"):
    if i < 0:
        return 0.0  # DeepSpeed's get_lr() before the first step
    w = max(2, warmup)
    if i < w:
        return base * (min_ratio + (1 - min_ratio) * warmup_fraction(i, warmup, kind))
    progress = min(1.0, (i - w + 1) / max(1, total - w))
    return base * max(0.0, cos_min + (1 - cos_min) * 0.5 * (1 + math.cos(math.pi * progress)))


def ds_one_cycle(i, lo, hi, up, down, decay_rate=0.0, decay_size=0, stairs=(0, 0)):
    """(lr, beta1 factor in [0, 1] of the way from max_mom down to min_mom, phase)."""
    total = up + down
    if i >= total:
        if decay_size == 0 or decay_rate == 0:
            return lo, None, "decay"
        return lo / (1 + decay_rate * (i - total + 1) / decay_size), None, "decay"
    t = (i + 1) % total  # position in the cycle: a triangle up over `up`, down over `down`
    if t <= up:
        frac = t / up if stairs[0] == 0 else math.floor(t * stairs[0] / up) / stairs[0]
    else:
        frac = (total - t) / down
        if stairs[1]:
            frac = math.floor((total - t) * stairs[1] / down) / stairs[1]
    return lo + (hi - lo) * frac, frac, "cycle"


def used_lrs(optimizer, scheduler, steps):
    """The learning rate of each group at optimizer steps 1..steps (the DeepSpeed engine and the
    Trainer step the scheduler after each optimizer step)."""
    out = []
    for _ in range(steps):
        out.append([g["lr"] for g in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    return out


def sgd(lr=0.5, groups=1):
    return torch.optim.SGD(
        [{"params": [torch.nn.Parameter(torch.ones(2))]} for _ in range(groups)], lr=lr
    )


def adamw(lr=0.5):
    return torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], lr=lr)


def check(lrs, expected, groups=1):
    assert len(lrs) == len(expected)
    for k, (got, want) in enumerate(zip(lrs, expected), start=1):
        assert got == pytest.approx([want] * groups, rel=1e-12, abs=1e-15), f"step {k}"


# --- schedules ------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr_defaults_and_warmup_types(kind):
    opt = sgd(lr=0.02)
    params = {} if kind == "log" else {"warmup_type": "linear"}  # log is the default
    lrs = used_lrs(opt, build_scheduler(opt, {"type": "WarmupLR", "params": params}), 1010)
    # Defaults: from 0 to the optimizer's learning rate over 1000 steps.
    check(lrs, [ds_warmup_lr(k - 2, 0.0, 0.02, 1000, kind) for k in range(1, 1011)])
    assert lrs[-1] == [0.02] and lrs[0] == [0.0]


def test_warmup_lr_has_at_least_two_warmup_steps():
    opt = sgd()
    section = {"type": "WarmupLR", "params": {"warmup_max_lr": 0.1, "warmup_num_steps": 1}}
    lrs = used_lrs(opt, build_scheduler(opt, section), 5)
    # W = max(2, 1): iterations -1 and 0 are at the minimum, log(2)/log(2) = 1 from iteration 1.
    assert lrs == [[0.0], [0.0], [0.1], [0.1], [0.1]]


def test_warmup_lr_per_group_values():
    opt = sgd(groups=2)
    params = {"warmup_min_lr": [0.01, 0.02], "warmup_max_lr": [0.1, 0.3], "warmup_num_steps": 4}
    lrs = used_lrs(opt, build_scheduler(opt, {"type": "WarmupLR", "params": params}), 8)
    for k, got in enumerate(lrs, start=1):
        want = [ds_warmup_lr(k - 2, 0.01, 0.1, 4), ds_warmup_lr(k - 2, 0.02, 0.3, 4)]
        assert got == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_decay_lr(kind):
    opt = sgd()
    params = {"total_num_steps": 20, "warmup_min_lr": 1e-5, "warmup_max_lr": 3e-4}
    params |= {"warmup_num_steps": 5, "warmup_type": kind}
    lrs = used_lrs(opt, build_scheduler(opt, {"type": "WarmupDecayLR", "params": params}), 25)
    check(lrs, [ds_warmup_decay_lr(k - 2, 20, 1e-5, 3e-4, 5, kind) for k in range(1, 26)])
    assert lrs[-1] == [1e-5]  # after total_num_steps: the minimum


def test_warmup_decay_lr_default_max_is_0_001():
    opt = sgd(lr=0.5)
    section = {"type": "WarmupDecayLR", "params": {"total_num_steps": 10, "warmup_num_steps": 3}}
    lrs = used_lrs(opt, build_scheduler(opt, section), 12)
    check(lrs, [ds_warmup_decay_lr(k - 2, 10, 0.0, 0.001, 3) for k in range(1, 13)])


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_cosine_lr(kind):
    opt = sgd(lr=0.2, groups=2)
    params = {"total_num_steps": 30, "warmup_min_ratio": 0.1, "warmup_num_steps": 6}
    params |= {"cos_min_ratio": 0.05, "warmup_type": kind}
    lrs = used_lrs(opt, build_scheduler(opt, {"type": "WarmupCosineLR", "params": params}), 40)
    want = [ds_warmup_cosine_lr(k - 2, 0.2, 30, 0.1, 6, 0.05, kind) for k in range(1, 41)]
    check(lrs, want, groups=2)
    assert lrs[0] == [0.0, 0.0] and lrs[-1] == pytest.approx([0.2 * 0.05] * 2)  # held at the end


def test_warmup_cosine_lr_defaults():
    opt = sgd(lr=0.2)
    scheduler = build_scheduler(
        opt, {"type": "WarmupCosineLR", "params": {"total_num_steps": 1200}}
    )
    assert isinstance(scheduler, WarmupCosineLR)
    check(
        used_lrs(opt, scheduler, 1300),
        [ds_warmup_cosine_lr(k - 2, 0.2, 1200) for k in range(1, 1301)],
    )


def test_one_cycle_lr_and_momentum():
    opt = adamw()
    params = {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 4}
    params |= {"cycle_second_step_size": 6, "decay_lr_rate": 0.5, "decay_step_size": 3}
    params |= {"cycle_min_mom": 0.85, "cycle_max_mom": 0.95, "decay_mom_rate": 0.01}
    scheduler = build_scheduler(opt, {"type": "OneCycle", "params": params})
    for k in range(1, 20):
        i = k - 2
        lr, frac, phase = ds_one_cycle(i, 0.01, 0.1, 4, 6, 0.5, 3)
        beta1, beta2 = opt.param_groups[0]["betas"]
        assert opt.param_groups[0]["lr"] == pytest.approx(lr, rel=1e-12), k
        if i < 0:
            assert beta1 == 0.85  # DeepSpeed's constructor sets cycle_min_mom
        elif phase == "cycle":  # momentum moves against the learning rate
            assert beta1 == pytest.approx(0.95 - (0.95 - 0.85) * frac, rel=1e-12), k
        else:  # DeepSpeed's post-cycle momentum decay multiplies cycle_max_mom
            assert beta1 == pytest.approx(0.95 * (1 + 0.01 * (i - 10 + 1) / 3), rel=1e-12), k
        assert beta2 == 0.99  # as DeepSpeed sets it
        opt.step()
        scheduler.step()


def test_one_cycle_stairs_and_no_decay():
    opt = sgd()
    params = {"cycle_min_lr": 0.0, "cycle_max_lr": 1.0, "cycle_first_step_size": 6}
    params |= {"cycle_first_stair_count": 3, "cycle_second_stair_count": 2}
    params |= {"cycle_second_step_size": 4}
    lrs = used_lrs(opt, build_scheduler(opt, {"type": "OneCycle", "params": params}), 16)
    check(lrs, [ds_one_cycle(k - 2, 0.0, 1.0, 6, 4, stairs=(3, 2))[0] for k in range(1, 17)])


def test_one_cycle_on_sgd_leaves_its_momentum(caplog):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1, momentum=0.7)
    section = {"type": "OneCycle", "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1}}
    with caplog.at_level(logging.WARNING):
        scheduler = build_scheduler(opt, section)
    assert isinstance(scheduler, OneCycle) and not scheduler.cycle_momentum
    assert "no betas" in caplog.text
    used_lrs(opt, scheduler, 3)
    assert opt.param_groups[0]["momentum"] == 0.7 and "betas" not in opt.param_groups[0]


def test_schedule_state_round_trips_through_weights_only_load(tmp_path):
    opt = sgd()
    section = {"type": "WarmupDecayLR", "params": {"total_num_steps": 12, "warmup_num_steps": 4}}
    scheduler = build_scheduler(opt, section)
    used_lrs(opt, scheduler, 5)
    torch.save((opt.state_dict(), scheduler.state_dict()), tmp_path / "s.pt")
    rest = used_lrs(opt, scheduler, 6)
    opt2 = sgd()
    resumed = build_scheduler(opt2, section)
    opt_state, state = torch.load(tmp_path / "s.pt", weights_only=True)
    opt2.load_state_dict(opt_state)
    resumed.load_state_dict(state)
    assert resumed.last_batch_iteration == 4  # five optimizer steps taken
    assert used_lrs(opt2, resumed, 6) == rest


# --- optimizers -----------------------------------------------------------------------------
def test_adam_is_adamw_unless_adam_w_mode_is_false():
    cls, kwargs = optimizer_spec({"type": "Adam", "params": {"lr": 1e-4}})
    assert cls is torch.optim.AdamW  # DeepSpeed's adam_w_mode defaults to true
    assert kwargs == {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    cls, _ = optimizer_spec({"type": "adam", "params": {"adam_w_mode": False, "torch_adam": True}})
    assert cls is torch.optim.Adam
    cls, _ = optimizer_spec({"type": "AdamW", "params": {"adam_w_mode": False}})
    assert cls is torch.optim.AdamW  # the name AdamW always decouples
    opt = build_optimizer(
        [torch.nn.Parameter(torch.ones(1))], {"type": "SGD", "params": {"lr": 0.3, "momentum": 0.9}}
    )
    assert isinstance(opt, torch.optim.SGD) and opt.defaults["momentum"] == 0.9


def test_auto_is_filled_from_the_training_arguments(tmp_path):
    from transformers import TrainingArguments

    args = TrainingArguments(
        output_dir=str(tmp_path), learning_rate=3e-4, adam_beta1=0.8, adam_beta2=0.97,
        adam_epsilon=1e-7, weight_decay=0.05, warmup_steps=0.25, use_cpu=True, report_to="none",
    )  # fmt: skip
    values = trainer_values(args, 40)
    auto = {k: "auto" for k in ("lr", "betas", "eps", "weight_decay")}
    _, kwargs = optimizer_spec({"type": "AdamW", "params": auto}, values)
    assert kwargs == {"lr": 3e-4, "betas": (0.8, 0.97), "eps": 1e-7, "weight_decay": 0.05}
    opt = sgd()
    params = {
        k: "auto" for k in ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps")
    }
    lrs = used_lrs(
        opt, build_scheduler(opt, {"type": "WarmupDecayLR", "params": params}, values), 42
    )
    check(lrs, [ds_warmup_decay_lr(k - 2, 40, 0.0, 3e-4, 10) for k in range(1, 43)])
    # No warm-up asked for: 1 (transformers keeps it positive; DeepSpeed then uses 2).
    args.warmup_steps = 0
    assert trainer_values(args, 40)["warmup_num_steps"] == 1


def test_scheduler_from_config_for_custom_loops():
    config = ZeroConfig.load(
        {
            "scheduler": {
                "type": "WarmupLR",
                "params": {"warmup_max_lr": "auto", "warmup_num_steps": "auto"},
            }
        }
    )
    opt = sgd(lr=0.04)
    lrs = used_lrs(opt, scheduler_from_config(opt, config, 100, warmup_steps=5), 8)
    check(lrs, [ds_warmup_lr(k - 2, 0.0, 0.04, 5) for k in range(1, 9)])
    assert scheduler_from_config(opt, ZeroConfig(), 100) is None


@pytest.mark.parametrize(
    "section, match",
    [
        ({"type": "Lamb", "params": {}}, r"'optimizer.type' = 'Lamb'.*allowed: Adam, AdamW, SGD"),
        ({"type": "AdamW", "params": {"lr": 1e-3, "betaz": [0.9, 0.9]}}, r"unknown key\(s\) \['betaz'\].*allowed: .*betas"),
        ({"type": "AdamW", "params": {"max_grad_norm": 1.0}}, r"max_grad_norm.*gradient_clipping"),
        ({"type": "Adam", "params": {"bias_correction": False}}, r"bias_correction"),
        ({"type": "SGD", "params": {"lr": "auto"}}, r"'optimizer.params.lr' = 'auto'.*nothing to fill"),
        ({"type": "AdamW", "param": {}}, r"unknown key\(s\) \['param'\]"),
    ],
)  # fmt: skip
def test_bad_optimizer_sections_name_the_key(section, match):
    with pytest.raises(ValueError, match=match):
        optimizer_spec(section)


@pytest.mark.parametrize(
    "section, match",
    [
        ({"type": "WarmupLr"}, r"'scheduler.type' = 'WarmupLr'.*WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle"),
        ({"type": "LRRangeTest"}, r"'LRRangeTest' is not supported"),
        ({"type": "WarmupLR", "params": {"total_num_steps": 10}}, r"'scheduler.params'.*\['total_num_steps'\].*allowed"),
        ({"type": "WarmupDecayLR", "params": {"warmup_num_steps": 3}}, r"WarmupDecayLR.*missing \['total_num_steps'\]"),
        ({"type": "WarmupLR", "params": {"warmup_num_steps": 0}}, r"'warmup_num_steps' = 0 must be a positive int"),
        ({"type": "WarmupLR", "params": {"warmup_type": "cosine"}}, r"'warmup_type' = 'cosine'; allowed: log, linear"),
        ({"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}, r"total_num_steps' = 'auto'"),
        ({"type": "OneCycle", "params": {"cycle_min_lr": "auto", "cycle_max_lr": 1}}, r"cycle_min_lr' = 'auto'"),
    ],
)  # fmt: skip
def test_bad_scheduler_sections_name_the_key(section, match):
    with pytest.raises(ValueError, match=match):
        build_scheduler(sgd(), section)


def test_bad_sections_fail_when_the_trainer_arguments_are_built(tmp_path):
    from hf_zero.integrations.trainer_arguments import ZeroTrainingArguments

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"scheduler": {"type": "WarmupDecay", "params": {}}}))
    with pytest.raises(ValueError, match=r"'scheduler\.type' = 'WarmupDecay'"):
        ZeroTrainingArguments(output_dir=str(tmp_path), zero_config=str(path), report_to="none")
    assert not dist.is_initialized()
