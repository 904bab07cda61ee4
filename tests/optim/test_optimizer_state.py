"""Optimizer state that exists before initialize() (Adagrad's eager state, a loaded state) is
re-keyed onto the master shards, element for element."""

import pytest
import torch
from helpers import BUCKET, batch, build_model

import hf_zero
from hf_zero.testing import run_distributed


def _existing_state(stage: int) -> dict:
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = batch(0, 0, 0)  # the same local step on every rank
    model(input_ids=x, labels=x).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    before = {id(p): {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    engine = hf_zero.initialize(model, optimizer, stage=stage, reduce_bucket_size=BUCKET)
    worst = 0.0
    for group in engine.groups:
        state = optimizer.state[group.master]
        assert int(state["step"]) == 1
        full = torch.zeros(group.layout.padded_numel)
        if group.layout.num_shards > 1:
            engine.comm.all_gather(full, state["exp_avg"], group.shard_group)
        else:
            full.copy_(state["exp_avg"])
        for slot, p in zip(group.layout.slots, group.params):
            expected = before[id(p)]["exp_avg"].reshape(-1)
            worst = max(worst, (full[slot.offset : slot.end] - expected).abs().max().item())
    return {"worst": worst}


@pytest.mark.parametrize("stage", [0, 2])
def test_existing_adam_state_is_sharded(stage):
    for r in run_distributed(_existing_state, 2, args=(stage,)):
        assert r["worst"] == 0.0


def _partial_state() -> None:
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters())
    first = next(p for p in model.parameters() if p.requires_grad)
    optimizer.state[first]["step"] = torch.tensor(1.0)
    hf_zero.initialize(model, optimizer, stage=1, reduce_bucket_size=10**9)


def test_partial_state_is_refused():
    with pytest.raises(AssertionError, match="optimizer state exists for only some parameters"):
        run_distributed(_partial_state, 2)
