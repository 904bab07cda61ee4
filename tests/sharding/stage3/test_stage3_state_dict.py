"""ZeRO-3 never hands out empty weights: ``model.state_dict()``, ``save_pretrained()`` without a
state dict and ``load_state_dict()`` work on the sharded model (collectively, on every rank);
models without ``_no_split_modules`` get one unit per repeated block; the Trainer reports the
real number of trainable parameters.

Tolerances: the same as test_stage3.py (fp32 parity with DDP 1e-6 relative, summation order
only); everything that compares the same values gathered two ways is exact.
"""

import datetime
import logging
import time

import pytest
import torch
import torch.distributed as dist
from helpers import (
    batch,
    build_model,
    named_fp32,
    rel_diff,
    still_gathered,
    train_ddp,
    two_param_groups,
)

import hf_zero
from hf_zero.sharding.stage3 import state_dict as stage3_state_dict
from hf_zero.sharding.stage3.units import find_units
from hf_zero.testing import run_distributed

ZERO3 = dict(param_persistence_threshold=50)  # norm weights (40) stay whole, matrices shard
FP32_TOL = 1e-6
CLIP = 0.3


def _engine(model, **cfg):
    return hf_zero.initialize(
        model, torch.optim.AdamW(two_param_groups(model)), stage=3, **{**ZERO3, **cfg}
    )


def _train(engine, steps: int) -> None:
    for step in range(steps):
        x = batch(dist.get_rank(), step, 0)
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()


def _equal(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(
        a[k].shape == b[k].shape and torch.equal(a[k].cpu(), b[k].cpu()) for k in b
    )


# --- state_dict() and save_pretrained() ---------------------------------------------------------


def _state_dict() -> dict:
    reference = build_model()
    model = build_model()
    engine = _engine(model, gradient_clipping=CLIP)
    state = model.state_dict()
    out = {
        "exact_at_init": _equal(state, reference.state_dict()),
        "empty": [k for k, v in state.items() if v.numel() == 0],
        "tied_alias": state["lm_head.weight"] is state["model.embed_tokens.weight"],
        "left_gathered": still_gathered(engine),
    }
    _train(engine, 2)
    _, ddp = train_ddp(2, 1, CLIP)
    state = model.state_dict()
    out["vs_ddp"] = max(rel_diff(state[k], ddp[k]) for k in ddp)
    out["same_as_gathered"] = all(torch.equal(state[k], v) for k, v in named_fp32(model).items())
    out["left_gathered"] += still_gathered(engine)
    return out


def test_state_dict_is_whole_and_equals_the_unsharded_and_ddp_models():
    for r in run_distributed(_state_dict, 2):
        assert r["exact_at_init"] and r["empty"] == [] and r["tied_alias"], r
        assert r["vs_ddp"] <= FP32_TOL and r["same_as_gathered"], r
        assert r["left_gathered"] == [], r


def _save_pretrained(directory: str) -> bool:
    from transformers import AutoModelForCausalLM

    model = build_model()
    engine = _engine(model)
    _train(engine, 1)
    model.save_pretrained(directory, is_main_process=dist.get_rank() == 0)  # no state_dict=
    dist.barrier()
    x = batch(0, 9, 0)
    with torch.no_grad():
        logits = model(input_ids=x).logits  # collective under stage 3: every rank runs it
        loaded = AutoModelForCausalLM.from_pretrained(directory)(input_ids=x).logits
    return torch.equal(logits, loaded)


def test_save_pretrained_without_a_state_dict_reloads_the_same_model(tmp_path):
    assert run_distributed(_save_pretrained, 2, args=(str(tmp_path),)) == [True, True]


def _submodules() -> dict:
    reference = build_model()
    model = build_model()
    engine = _engine(model)
    out = {}
    for name in (
        "model.layers.0",  # a unit
        "model.layers.1.mlp",  # inside a unit
        "model.layers.0.self_attn.q_proj",
        "model.embed_tokens",  # owned by the root unit
        "lm_head",  # tied to the embedding
        "model",
    ):
        mine = model.get_submodule(name).state_dict()
        out[name] = _equal(mine, reference.get_submodule(name).state_dict())
    out["left_gathered"] = still_gathered(engine)
    return out


def test_submodule_state_dicts_are_whole():
    for r in run_distributed(_submodules, 2):
        assert r.pop("left_gathered") == [], r
        assert all(r.values()), r


def _peft_mixz() -> dict:
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    from hf_zero.tiny import tiny_llama

    model = get_peft_model(tiny_llama(0), LoraConfig(r=4, target_modules=["q_proj", "up_proj"]))
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine = hf_zero.initialize(
        model,
        torch.optim.AdamW(trainable, lr=1e-2),
        stage=3,
        precision="bf16",
        quantized_nontrainable_weights=True,  # MixZ++: the frozen base is INT8 shards
        param_persistence_threshold=100,
    )
    _train(engine, 1)
    full = engine.full_state_dict(rank0_only=False)
    state = model.state_dict()
    adapters = get_peft_model_state_dict(model)  # calls model.state_dict() itself
    return {
        "frozen_sharded": sum(g.numel for g in engine.frozen_groups) > 0,
        "same_as_full": _equal(state, full),
        "adapters": len(adapters) == 8
        and all(
            torch.equal(v, full[k.replace(".weight", ".default.weight")])
            for k, v in adapters.items()
        ),
        "left_gathered": still_gathered(engine),
    }


def test_state_dict_of_a_mixz_lora_model_equals_full_state_dict():
    for r in run_distributed(_peft_mixz, 2):
        assert r == {
            "frozen_sharded": True,
            "same_as_full": True,
            "adapters": True,
            "left_gathered": [],
        }


# --- load_state_dict() ----------------------------------------------------------------------------


def _load_state_dict(precision: str) -> dict:
    other = build_model(seed=5)
    model = build_model()
    engine = _engine(model, precision=precision, gradient_clipping=CLIP)
    missing, unexpected = model.load_state_dict(other.state_dict())
    dtype = engine.dtype
    expected = {n: p.detach().to(dtype).float() for n, p in other.named_parameters()}
    whole = named_fp32(model)
    master = engine.full_state_dict(master_weights=True, rank0_only=False)
    out = {
        "keys": (missing, unexpected),
        "params": all(torch.equal(whole[n], v) for n, v in expected.items()),
        "masters": all(torch.equal(master[n].float(), v) for n, v in expected.items()),
        "left_gathered": still_gathered(engine),
    }
    try:
        model.load_state_dict(other.state_dict(), assign=True)
    except ValueError as error:
        out["assign"] = str(error)
    if precision == "fp32":  # training goes on from the loaded weights (masters and shards)
        _train(engine, 2)
        _, ddp = train_ddp(2, 1, CLIP, seed=5)
        out["vs_ddp"] = max(rel_diff(v, ddp[k]) for k, v in named_fp32(model).items())
    return out


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_load_state_dict_writes_shards_and_master_weights(precision):
    for r in run_distributed(_load_state_dict, 2, args=(precision,)):
        assert r["keys"] == ([], []) and r["left_gathered"] == [], r
        assert r["params"] and r["masters"], r
        assert "assign=False" in r["assign"], r
        assert r.get("vs_ddp", 0.0) <= FP32_TOL, r


def _tensor_parallel() -> dict:
    even = dict(vocab_size=250, intermediate_size=96)  # every split dimension even
    reference = build_model(**even)
    model = build_model(**even)
    engine = _engine(model, tp_size=2)
    out = {
        "split": sum(engine.tp.shard_of(p) is not None for p in model.parameters()),
        "exact": _equal(model.state_dict(), reference.state_dict()),  # TP slices gathered too
        "left_gathered": still_gathered(engine),
    }
    try:
        model.load_state_dict(reference.state_dict())
    except NotImplementedError as error:
        out["load"] = str(error)
    return out


def test_state_dict_under_tensor_parallelism_is_whole_and_load_says_why_not():
    for r in run_distributed(_tensor_parallel, 2):
        assert r["split"] > 0 and r["exact"] and r["left_gathered"] == [], r
        assert "before hf_zero.initialize()" in r["load"], r


# --- collective misuse ----------------------------------------------------------------------------


def _one_rank_only() -> str | None:
    stage3_state_dict.SYNC_TIMEOUT = datetime.timedelta(seconds=1)
    model = build_model()
    _engine(model)
    if dist.get_rank() == 1:
        time.sleep(3)  # never calls state_dict()
        return None
    try:
        model.state_dict()
    except RuntimeError as error:
        return str(error)
    return "no error"


def _after_destroy() -> str:
    model = build_model()
    _engine(model)
    dist.destroy_process_group()
    try:
        model.state_dict()
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_state_dict_on_one_rank_or_without_a_process_group_says_what_to_do():
    rank0, rank1 = run_distributed(_one_rank_only, 2)
    assert rank1 is None
    assert "every rank must call it" in rank0 and "engine.full_state_dict()" in rank0, rank0
    for message in run_distributed(_after_destroy, 2):
        assert "process group is gone" in message and "gathered_parameters" in message, message


# --- units of a model without _no_split_modules -------------------------------------------------

VOCAB, WIDTH = 61, 24


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.up = torch.nn.Linear(WIDTH, 2 * WIDTH)
        self.down = torch.nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Net(torch.nn.Module):
    """No ``_no_split_modules``: an embedding, a ModuleList of identical blocks, a head."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(3))
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h)
        logits = self.head(h)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), input_ids.flatten())


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record) -> None:
        self.messages.append(record.getMessage())


def _units_parity() -> dict:
    records = _Records()
    logger = logging.getLogger("hf_zero")
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    reference = torch.nn.parallel.DistributedDataParallel(Net())
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    model = Net()
    engine = hf_zero.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), **ZERO3, stage=3
    )
    for step in range(2):
        x = batch(dist.get_rank(), step, 0, vocab=VOCAB)
        reference(x).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        engine.backward(engine(x))
        engine.step()
    ref_state = reference.module.state_dict()
    state = model.state_dict()
    return {
        "units": [(u.name, len(u.groups) > 0) for u in engine.units],
        "log": [m for m in records.messages if "stage 3 units" in m],
        "keys": list(state) == list(ref_state),
        "diff": max(rel_diff(state[k], ref_state[k]) for k in ref_state),
    }


def test_model_without_no_split_modules_gets_one_unit_per_repeated_block():
    for rank, r in enumerate(run_distributed(_units_parity, 2)):
        blocks = [(f"blocks.{i}", True) for i in range(3)]
        assert r["units"] == [("<root>", True), *blocks], r
        expected = [
            "hf_zero: stage 3 units: 3 x Block from blocks (model has no _no_split_modules)"
        ]
        assert r["log"] == (expected if rank == 0 else []), r
        assert r["keys"] and r["diff"] <= FP32_TOL, r


def test_gpt2_without_no_split_modules_gets_its_blocks_and_the_fallback_is_logged(caplog):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64))
    for module in gpt2.modules():
        module._no_split_modules = None
    assert [name for name, _ in find_units(gpt2)] == ["", "transformer.h.0", "transformer.h.1"]
    caplog.set_level(logging.INFO, logger="hf_zero")
    find_units(gpt2, log=True)
    assert "2 x GPT2Block from transformer.h (model has no _no_split_modules)" in caplog.text

    plain = torch.nn.Module()
    plain.a, plain.b, plain.c = torch.nn.Linear(4, 4), torch.nn.Conv1d(4, 4, 1), torch.nn.ReLU()
    plain.d = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Conv1d(4, 4, 1)])
    caplog.clear()
    assert [name for name, _ in find_units(plain, log=True)] == ["", "a", "b", "d.0", "d.1"]
    assert "one per child with parameters, 4: a, b, d.0, d.1" in caplog.text


# --- parameter counts -----------------------------------------------------------------------------


def _trainer_count(directory: str) -> dict:
    from hf_zero import ZeroTrainer, ZeroTrainingArguments

    records = _Records()
    logging.getLogger("transformers.trainer").addHandler(records)
    model = build_model()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    flops_per_token = 6 * model.num_parameters(exclude_embeddings=True)
    args = ZeroTrainingArguments(
        output_dir=directory,
        zero_stage=3,
        per_device_train_batch_size=2,
        max_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        log_level="info",
        log_level_replica="info",
    )
    data = [{"input_ids": x, "labels": x} for x in batch(dist.get_rank(), 0, 0).repeat(2, 1)]
    trainer = ZeroTrainer(model=model, args=args, train_dataset=data)
    trainer.train()
    counted = [m for m in records.messages if "Number of trainable parameters" in m]
    x = batch(0, 0, 0)
    return {
        "sharded": sum(g.numel for g in trainer.engine.groups if g.stage == 3) > 0,
        "logged": [int(m.split("=")[1].replace(",", "")) for m in counted],
        "expected": trainable,
        "helper": hf_zero.num_parameters(model, only_trainable=True),
        "flops": (trainer.floating_point_ops({"input_ids": x}), flops_per_token * x.numel()),
    }


def test_trainer_logs_the_real_number_of_trainable_parameters(tmp_path):
    for r in run_distributed(_trainer_count, 2, args=(str(tmp_path),)):
        assert r["sharded"], r
        assert r["logged"] == [r["expected"]] and r["helper"] == r["expected"], r
        assert r["flops"][0] == r["flops"][1], r


def _saved_dtypes() -> dict:
    out = {}
    for save_16bit in (False, True):
        model = build_model()
        frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
        original = {n: p.detach().clone() for n, p in model.named_parameters()}
        engine = _engine(model, precision="bf16", save_16bit_model=save_16bit)
        x = batch(dist.get_rank(), 0, 0)
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
        saved = engine.saved_state_dict()
        masters = engine.full_state_dict(master_weights=True)
        trained = engine.full_state_dict()
        if dist.get_rank() != 0:
            continue
        out[save_16bit] = {
            "dtypes": sorted({str(v.dtype) for v in saved.values()}),
            "equals_masters": all(
                torch.equal(saved[k], masters[k]) for k in saved if k not in frozen
            ),
            "equals_trained": all(torch.equal(saved[k], trained[k]) for k in saved),
            "frozen_kept_as_trained": all(
                torch.equal(saved[k], original[k].to(torch.bfloat16).to(saved[k].dtype))
                for k in frozen
            ),
            "masters_moved": any(
                not torch.equal(masters[k].float(), original[k]) for k in original
            ),
        }
    return out


def test_saved_weights_keep_their_dtype_before_training_unless_16bit_is_asked():
    """An fp32 model trained in bf16 is saved from its fp32 master weights in fp32, as the same
    script saves without hf_zero (autocast keeps fp32 weights); ``save_16bit_model`` saves what
    was trained, in bf16. A frozen weight held in bf16 is saved as that bf16 value."""
    r = run_distributed(_saved_dtypes, 2)[0]
    assert r[False]["dtypes"] == ["torch.float32"] and r[True]["dtypes"] == ["torch.bfloat16"], r
    assert r[False]["equals_masters"] and r[False]["masters_moved"], r
    assert r[False]["frozen_kept_as_trained"] and r[True]["frozen_kept_as_trained"], r
    assert r[True]["equals_trained"] and not r[False]["equals_trained"], r
