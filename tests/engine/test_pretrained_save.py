"""The streamed ``save_pretrained`` (`hf_zero.engine.pretrained_save`): one group gathered at a
time, written as Hugging Face sharded safetensors.

For each mode the files must hold exactly what ``engine.saved_state_dict()`` gathers whole
(bitwise: the same values taken two ways), under the names transformers' own
``save_pretrained(dir, state_dict=...)`` writes (tied weights once, MoE experts in checkpoint
format), and ``from_pretrained`` must load them back to the same state dict. A second test
measures from outside (VmHWM) that saving never brings the whole model into memory.
"""

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import batch, build_model, two_param_groups
from safetensors.torch import load_file

import hf_zero
from hf_zero.testing import run_distributed

ZERO3 = dict(param_persistence_threshold=50)
MODES = {
    "stage3": dict(stage=3, **ZERO3),
    "stage3-bf16-offload": dict(stage=3, precision="bf16", offload_optimizer="cpu", **ZERO3),
    "stage3-nvme": dict(stage=3, offload_param="nvme", offload_optimizer="nvme", **ZERO3),
    "stage2": dict(stage=2),
}
SHARD = 20_000  # bytes: the tiny model's weights split over several files


def _mixtral(seed: int = 0) -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    config = MixtralConfig(
        vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    return MixtralForCausalLM(config)


def _train_and_save(out: str, mode: str, model_name: str) -> dict:
    model = build_model() if model_name == "llama" else _mixtral()
    cfg = dict(MODES[mode])
    if "nvme" in cfg.values():
        cfg["nvme_path"] = os.path.join(out, f"swap{dist.get_rank()}")
    engine = hf_zero.initialize(model, torch.optim.AdamW(two_param_groups(model)), **cfg)
    for step in range(2):
        x = batch(dist.get_rank(), step, 0, vocab=model.config.vocab_size)
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
    saved = os.path.join(out, "saved")
    engine.save_pretrained(saved, is_main_process=dist.get_rank() == 0, max_shard_size=SHARD)
    model.save_pretrained(os.path.join(out, "model_call"), is_main_process=dist.get_rank() == 0)
    whole = engine.saved_state_dict()  # the same values, gathered whole
    if dist.get_rank() == 0:  # transformers' own writer, for the names it uses
        model.save_pretrained(os.path.join(out, "reference"), state_dict=dict(whole))
    dist.barrier()
    return whole


def _files(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    names = (
        set(json.loads(index.read_text())["weight_map"].values())
        if index.exists()
        else {"model.safetensors"}
    )
    state = {}
    for name in sorted(names):
        state.update(load_file(folder / name))
    return state


@pytest.mark.parametrize(
    "mode,model_name",
    [(m, "llama") for m in MODES] + [("stage3", "mixtral")],
)
def test_streamed_save_equals_the_gathered_state_dict_and_loads(tmp_path, mode, model_name):
    from transformers import AutoModelForCausalLM

    whole = run_distributed(_train_and_save, 2, args=(str(tmp_path), mode, model_name))[0]
    saved, reference = tmp_path / "saved", tmp_path / "reference"
    written = _files(saved)
    expected = _files(reference)
    assert sorted(written) == sorted(expected)  # the same names as transformers writes
    assert all(torch.equal(written[k], expected[k]) for k in expected)
    index = json.loads((saved / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # several files, as asked
    sizes = sum((saved / f).stat().st_size for f in set(index["weight_map"].values()))
    assert index["metadata"]["total_size"] <= sizes
    assert not list(saved.glob(".*.partial"))
    # The model's own save_pretrained(dir) takes the same streamed path under stage 3.
    if MODES[mode]["stage"] == 3:
        from_model = _files(tmp_path / "model_call")
        assert sorted(from_model) == sorted(written)
        assert all(torch.equal(from_model[k], written[k]) for k in written)

    loaded = AutoModelForCausalLM.from_pretrained(saved).state_dict()
    assert sorted(loaded) == sorted(whole)
    mismatched = [k for k in whole if not torch.equal(loaded[k], whole[k])]
    assert not mismatched, mismatched
    config = json.loads((saved / "config.json").read_text())
    assert config["dtype"] == str(next(iter(whole.values())).dtype).removeprefix("torch.")


def _adapter_save(out: str) -> dict:
    from helpers import lora_engine, lora_model, train_on_corpus
    from peft import get_peft_model_state_dict

    model = lora_model()
    engine = lora_engine(model)
    train_on_corpus(engine, 2)
    calls = []
    hooks_gather = engine.state_dict_hooks._gather
    engine.state_dict_hooks._gather = lambda groups: (
        calls.append(len(groups)) or hooks_gather(groups)
    )
    model.save_pretrained(out, is_main_process=dist.get_rank() == 0)
    gathered_by_hooks = sum(calls)  # the routed save never asks for model.state_dict()
    engine.state_dict_hooks._gather = hooks_gather
    whole = get_peft_model_state_dict(model)  # collective: the whole model through the hooks
    dist.barrier()
    return {"adapter": {k: v.clone() for k, v in whole.items()}, "hooks": gathered_by_hooks}


def test_a_peft_save_gathers_the_adapter_alone(tmp_path):
    """Under stage 3 a PEFT model's own ``save_pretrained(dir)`` takes the adapter gathered by
    itself (the frozen base never gathered) and writes what PEFT writes from the whole model."""
    r = run_distributed(_adapter_save, 2, args=(str(tmp_path),))[0]
    assert r["hooks"] == 0
    written = load_file(tmp_path / "adapter_model.safetensors")
    expected = {k: v for k, v in r["adapter"].items()}
    assert sorted(written) == sorted(expected)
    assert all(torch.equal(written[k], expected[k].to(written[k].dtype)) for k in expected)
