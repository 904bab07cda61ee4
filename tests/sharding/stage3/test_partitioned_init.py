"""partitioned_init(): a model that is never whole on a rank, loaded from safetensors slices."""

import pytest
import torch
import torch.distributed as dist
from helpers import batch, build_model, two_param_groups

import hf_zero
from hf_zero.sharding.stage3.partitioned_init import preshard_of
from hf_zero.testing import run_distributed

THRESHOLD = 50  # norm weights (40) stay whole, every matrix is sliced


def _build_and_load(checkpoint: str, stage: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        build_model(seed=3).save_pretrained(checkpoint)  # the "pretrained" weights
    dist.barrier()
    with hf_zero.partitioned_init(param_persistence_threshold=THRESHOLD) as built:
        model = build_model(seed=11)
    preshards = [preshard_of(m) for m in model.modules() if preshard_of(m) is not None]
    whole = {n: p.numel() for n, p in model.named_parameters() if p.numel() > 0}
    out = {
        "roots": [type(m).__name__ for m in built],
        "largest_whole": max(whole.values()),
        "slices": sum(pre.shard.numel() for pre in preshards),
        "padded": sum(pre.layout.padded_numel for pre in preshards),
        "world": world,
    }
    out.update(hf_zero.load_partitioned(model, checkpoint))
    engine = hf_zero.initialize(
        model,
        torch.optim.AdamW(two_param_groups(model)),
        stage=stage,
        param_persistence_threshold=THRESHOLD,
    )
    x = batch(0, 5, 0)
    with torch.no_grad():
        logits = model(input_ids=x).logits
        expected = build_model(seed=3)(input_ids=x).logits
    out["logits_equal"] = torch.equal(logits, expected)
    # It still trains: one step runs and changes the loss.
    before = model(input_ids=x, labels=x).loss
    engine.backward(before)
    engine.step()
    with torch.no_grad():
        out["trained"] = model(input_ids=x, labels=x).loss.item() < before.item()
    return out


@pytest.mark.parametrize("stage", [3, 2])
def test_partitioned_model_loads_checkpoint_slices_and_matches(tmp_path, stage):
    for r in run_distributed(_build_and_load, 2, args=(str(tmp_path), stage)):
        assert r["roots"] == ["LlamaForCausalLM"]
        # Nothing large is ever whole: only the small norms hold full values after init.
        assert r["largest_whole"] < THRESHOLD
        assert r["slices"] * r["world"] == r["padded"]
        # Each rank read its slices of the sliced tensors, about 1/N of them, and the small ones.
        assert r["elements_read"] < 0.6 * r["elements_total"]
        assert r["logits_equal"] and r["trained"]
