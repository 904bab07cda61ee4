"""``from_pretrained`` inside ``hf_zero.partitioned_init()``: each rank keeps only its slices.

Against a whole ``from_pretrained`` of the same checkpoint in the same run (bf16, NF4/FP4
through bitsandbytes, with and without double quantization, LLM.int8, and a checkpoint saved
already in NF4):

* what each rank holds after loading is its half of every large weight (values, or the bytes
  of codes and scales), within the padding, and nothing is left on the meta device;
* after `initialize` and 3 LoRA steps the quantized bytes gathered on every rank are bitwise
  those of the whole load, and the losses are identical (same bytes, same sharding);
* also after PEFT's ``prepare_model_for_kbit_training`` (what TRL runs on a quantized base),
  which casts the sliced 16-bit weights' empty placeholders to fp32: they come back in fp32;
* a load that fails inside the block leaves ``from_pretrained`` and torch's hooks as they were;
  ranks that loaded different checkpoints are refused at `initialize` on every rank (the
  gathered bytes are checked against each rank's checksum of what it loaded).
"""

import bitsandbytes  # noqa: F401  (a test dependency: missing, fail, never skip)
import pytest
import torch
import torch.distributed as dist
from helpers import QLORA_MODEL, load_quantized
from test_qlora import _engine, _train, quantized_bytes

import hf_zero
from hf_zero.numerics.packed import is_packed, packed_bytes
from hf_zero.sharding.stage3.partitioned_load import slice_of
from hf_zero.testing import run_distributed
from hf_zero.tiny import tiny_llama


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("partitioned_load") / "base"
    tiny_llama(0, initializer_range=0.2, **QLORA_MODEL).save_pretrained(path)
    tiny_llama(1, initializer_range=0.2, **QLORA_MODEL).save_pretrained(f"{path}-other")
    # A checkpoint saved already quantized (as QLoRA bases are shared on the Hub).
    load_quantized(str(path), "nf4-double", lora=False).save_pretrained(f"{path}-nf4")
    return str(path)


def _load(path: str, quant: str):
    """``quant``: bf16, a `QUANTS` entry, or ``saved-nf4`` (the checkpoint saved in NF4)."""
    if quant not in ("bf16", "saved-nf4"):
        return load_quantized(path, quant, lora=False)
    from transformers import AutoModelForCausalLM

    if quant == "saved-nf4":
        path = f"{path}-nf4"
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)


def _lora(model, kbit: bool):
    """LoRA on every linear layer, after PEFT's ``prepare_model_for_kbit_training`` (what TRL
    runs on a quantized base: 16-bit weights cast to fp32) when ``kbit``."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if kbit:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    torch.manual_seed(1)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
    return get_peft_model(model, lora).train()


def _bytes(p: torch.Tensor) -> int:
    return packed_bytes(p) if is_packed(p) else p.numel() * p.element_size()


def _partitioned_vs_whole(path: str, quant: str, stage: int, kbit: bool) -> dict:
    whole = _load(path, quant)
    whole_bytes = {n: _bytes(p) for n, p in whole.named_parameters()}
    fresh = quantized_bytes(_lora(whole, kbit=False))  # names as under PEFT
    del whole

    with hf_zero.partitioned_init(stage=3, param_persistence_threshold=0) as roots:
        model = _load(path, quant)
    sliced = {n: slice_of(p) for n, p in model.named_parameters() if slice_of(p) is not None}
    held = {n: _bytes(p) for n, p in model.named_parameters()}
    slice_bytes = sum(s.shard.nbytes for s in sliced.values())
    quant_state_left = sum(packed_bytes(p) for p in model.parameters() if is_packed(p))
    meta = [n for n, p in model.named_parameters() if p.is_meta]

    model = _lora(model, kbit)
    engine = _engine(model, stage)
    losses = _train(engine, 3, same_batch=True)
    gathered = quantized_bytes(model)
    differing = [k for k in fresh if not torch.equal(gathered.get(k, torch.empty(0)), fresh[k])]
    engine.close()

    reference = _engine(_lora(_load(path, quant), kbit), stage)
    expected = _train(reference, 3, same_batch=True)
    reference.close()
    return {
        "roots": len(roots),
        "meta": meta,
        "sliced": sorted(sliced),
        "sliced_whole_bytes": sum(whole_bytes[n] for n in sliced),
        "slice_bytes": slice_bytes,
        "slice_count": len(sliced),
        "unsliced_held": sum(b for n, b in held.items() if n not in sliced),
        "quant_state_left": quant_state_left,
        "checked": len(fresh),
        "differing": differing,
        "losses": losses,
        "expected": expected,
        "world": dist.get_world_size(),
    }


CASES = [("bf16", 3), ("nf4-bf16", 3), ("nf4-double", 3), ("fp4-uint8", 3), ("int8", 3)]
CASES += [("saved-nf4", 3), ("nf4-bf16", 2)]
CASES = [(*case, False) for case in CASES] + [("nf4-bf16", 3, True), ("int8", 3, True)]


@pytest.mark.parametrize(("quant", "stage", "kbit"), CASES)
def test_from_pretrained_keeps_only_slices_and_trains_as_a_whole_load(base_dir, quant, stage, kbit):
    args = (base_dir, quant, stage, kbit)
    for r in run_distributed(_partitioned_vs_whole, 2, args=args):
        assert r["roots"] == 1 and r["meta"] == []
        # Every weight is sliced (threshold 0): embeddings, norms, and each linear layer.
        assert r["slice_count"] == 2 * 9 + 2, r["sliced"]
        # Each rank holds half of every weight's bytes (values; codes and 4-bit scales), padded
        # (16 bytes per part, 8 N elements), plus the small state every rank keeps whole (code
        # books, nested statistics, int8 row scales).
        whole_state = r["quant_state_left"]
        half = (r["sliced_whole_bytes"] - whole_state) / r["world"]
        assert half <= r["slice_bytes"] <= half + 64 * r["slice_count"], (half, r["slice_bytes"])
        if quant == "bf16":
            assert r["unsliced_held"] == 0 and r["quant_state_left"] == 0
        else:  # only what stays whole on every rank: code books, int8 row scales
            assert r["checked"] >= 14
            assert r["differing"] == [], r["differing"][:5]
        assert r["losses"] == r["expected"], (r["losses"], r["expected"])
        assert r["losses"][-1] < r["losses"][0]


def _failed_load(path: str) -> dict:
    from transformers import AutoModelForCausalLM, PreTrainedModel

    original = PreTrainedModel.__dict__["from_pretrained"]
    hooks = dict(torch.nn.modules.module._global_parameter_registration_hooks)
    try:
        with hf_zero.partitioned_init(stage=3):
            AutoModelForCausalLM.from_pretrained(path + "-missing")
    except OSError as error:
        raised = str(error)
    after = dict(torch.nn.modules.module._global_parameter_registration_hooks)
    # Outside the block from_pretrained loads whole again.
    model = AutoModelForCausalLM.from_pretrained(path)
    return {
        "raised": raised,
        "restored": PreTrainedModel.__dict__["from_pretrained"] is original,
        "hooks_left": len(after) - len(hooks),
        "sliced": sum(slice_of(p) is not None for p in model.parameters()),
    }


def test_a_failed_load_leaves_from_pretrained_as_it_was(base_dir):
    (r,) = run_distributed(_failed_load, 1, args=(base_dir,))
    assert "-missing" in r["raised"]
    assert r["restored"] and r["hooks_left"] == 0 and r["sliced"] == 0


def _different_checkpoints(path: str, quant: str) -> str:
    with hf_zero.partitioned_init(stage=3):
        model = _load(path if dist.get_rank() == 0 else f"{path}-other", quant)
    try:
        _engine(_lora(model, kbit=False), 3)
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("quant", ["bf16", "nf4-bf16"])
def test_ranks_that_loaded_different_checkpoints_are_refused(base_dir, quant):
    for message in run_distributed(_different_checkpoints, 2, args=(base_dir, quant)):
        assert "checksums differ" in message and "same checkpoint" in message, message
