"""full_state_dict(): complete weights for save_pretrained, gathered from the shards."""

import torch
import torch.distributed as dist
from helpers import BUCKET, batch, build_model, rel_diff, two_param_groups

import hf_zero
from hf_zero.testing import run_distributed


def _state(stage: int, precision: str) -> dict:
    model = build_model()
    engine = hf_zero.initialize(
        model,
        torch.optim.AdamW(two_param_groups(model)),
        stage=stage,
        precision=precision,
        reduce_bucket_size=BUCKET,
    )
    for step in range(2):
        x = batch(dist.get_rank(), step, 0)
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
    state = engine.full_state_dict()
    master = engine.full_state_dict(master_weights=True)
    out = {"keys": sorted(state), "master_keys": sorted(master)}
    if dist.get_rank() == 0:
        # The 16-bit state loads into a fresh model and reproduces its outputs.
        fresh = build_model(seed=123)
        for p in fresh.parameters():  # buffers stay fp32, as hf_zero leaves them
            p.data = p.data.to(model.dtype)
        fresh.load_state_dict(state)
        x = batch(0, 99, 0)
        with torch.no_grad():
            out["logits_equal"] = torch.equal(fresh(input_ids=x).logits, model(input_ids=x).logits)
        out["dtypes"] = {v.dtype for v in state.values()}
        # fp32 masters round to the model's weights and are fp32.
        name = "model.layers.0.mlp.up_proj.weight"
        out["master_dtype"] = master[name].dtype
        out["master_close"] = rel_diff(master[name].to(model.dtype).float(), state[name].float())
        out["tied"] = torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    return out


def test_full_state_dict_on_rank0_stage2_bf16():
    rank0, rank1 = run_distributed(_state, 2, args=(2, "bf16"))
    assert rank1["keys"] == [] and rank1["master_keys"] == []
    assert rank0["logits_equal"] and rank0["tied"]
    assert rank0["dtypes"] == {torch.bfloat16}
    assert rank0["master_dtype"] == torch.float32 and rank0["master_close"] == 0.0
