"""`initialize` returns an engine of one surface: `ZeroEngine` and `PipelineEngine` both have
``train_batch``, ``eval_batch``, checkpoints, state dicts and reports; what only `ZeroEngine`
has (the hand-written loop) raises on a `PipelineEngine` with a message that names
``train_batch``."""

import pytest
import torch
import torch.distributed as dist
from helpers import BATCH, SEQ, build_model, named_fp32, zero_engine

import hf_zero
from hf_zero.engine import Engine
from hf_zero.testing import run_distributed

GAS = 2


def _window(rank: int, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    ids = torch.randint(0, 251, (GAS * BATCH, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}


def _zero_train_batch_equals_the_loop(stage: int) -> dict:
    rank = dist.get_rank()
    out = {}
    for how in ("loop", "train_batch"):
        model = build_model(0)
        engine = zero_engine(model, stage=stage, gradient_accumulation_steps=GAS)
        losses = []
        for step in range(3):
            window = _window(rank, step)
            if how == "train_batch":
                losses.append(engine.train_batch(window))
                continue
            micro = []
            for i in range(GAS):
                piece = {k: v[i * BATCH : (i + 1) * BATCH] for k, v in window.items()}
                loss = engine(**piece).loss
                engine.backward(loss)
                micro.append(loss.item())
            assert engine.step()
            losses.append(sum(micro) / GAS)
        evaluated = engine.eval_batch(_window(rank, 9))
        with torch.no_grad():
            direct = engine(**_window(rank, 9)).loss.item()
        out[how] = {"losses": losses, "params": named_fp32(model), "eval": (evaluated, direct)}
        out[how]["steps"] = engine.global_steps
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_train_batch_is_the_hand_written_loop(stage):
    for r in run_distributed(_zero_train_batch_equals_the_loop, 2, args=(stage,)):
        loop, batched = r["loop"], r["train_batch"]
        assert batched["steps"] == loop["steps"] == 3
        assert batched["losses"] == pytest.approx(loop["losses"], rel=1e-6, abs=0)
        for name, value in loop["params"].items():
            assert torch.equal(value, batched["params"][name]), name
        evaluated, direct = batched["eval"]
        assert evaluated == pytest.approx(direct, rel=1e-6)


def _pipeline_surface() -> dict:
    model = build_model(0)
    engine = hf_zero.initialize(model, torch.optim.AdamW(model.parameters()), pp_size=2)
    window = _window(dist.get_rank() // 2, 0)
    errors = {}
    for call, run in {
        "engine(batch)": lambda: engine(**window),
        "engine.backward(loss)": lambda: engine.backward(torch.zeros(())),
        "engine.step()": engine.step,
        "engine.zero_grad()": engine.zero_grad,
        "gathered_parameters": engine.gathered_parameters,
    }.items():
        with pytest.raises(NotImplementedError) as error:
            run()
        errors[call] = str(error.value)
    loss = engine.train_batch(window)
    return {
        "kind": type(engine).__name__,
        "is_engine": isinstance(engine, Engine),
        "errors": errors,
        "loss": loss,
        "eval": engine.eval_batch(window),
        "report": sorted(engine.memory_report()),
        "full": sorted(engine.full_state_dict()),
        "comm_stats": type(engine.comm_stats).__name__,
    }


def test_a_pipeline_engine_has_the_shared_surface_and_names_train_batch_for_the_rest():
    results = run_distributed(_pipeline_surface, 2)
    for rank, r in enumerate(results):
        assert r["kind"] == "PipelineEngine" and r["is_engine"], r
        for call, message in r["errors"].items():
            if call == "gathered_parameters":
                assert "full_state_dict()" in message, message
            else:
                assert f"has no {call}" in message and "engine.train_batch(batch)" in message
        assert r["loss"] > 0 and r["eval"] > 0
        # The kinds a ZeroEngine reports (the pipeline's stages are the same flat groups).
        kinds = {"params", "grads", "master_weights", "optimizer_states", "total"}
        assert kinds | {"host_total", "nvme_total", "host_optimizer_states"} <= set(r["report"])
        assert r["comm_stats"] == "CommStats"
        expected = sorted(name for name, _ in build_model(0).named_parameters())
        assert r["full"] == (expected if rank == 0 else [])


def _mistakes() -> list[str]:
    model = build_model(0)
    engine = zero_engine(model, stage=2, gradient_accumulation_steps=GAS)
    window = _window(dist.get_rank(), 0)
    messages = []
    for bad in (
        lambda: engine.train_batch(window, microbatches=4),
        lambda: engine.train_batch({"input_ids": window["input_ids"]}),
        lambda: engine.train_batch({**window, "labels": window["labels"][:1]}),
    ):
        with pytest.raises(ValueError) as error:
            bad()
        messages.append(str(error.value))
    return messages


def test_train_batch_mistakes_are_named():
    microbatches, no_labels, ragged = run_distributed(_mistakes, 2)[0]
    assert "'gradient_accumulation_steps' = 2" in microbatches
    assert "returned no loss; give the batch 'labels'" in no_labels
    assert "differ in their first dimension" in ragged


def test_the_engines_share_one_declared_surface():
    from hf_zero.engine.pipeline_engine import PipelineEngine
    from hf_zero.engine.zero_engine import ZeroEngine

    shared = set(Engine.__abstractmethods__)
    assert {"train_batch", "eval_batch", "save_checkpoint", "load_checkpoint"} <= shared
    assert {"full_state_dict", "memory_report", "comm_stats"} <= shared
    for cls in (ZeroEngine, PipelineEngine):
        assert issubclass(cls, Engine) and not cls.__abstractmethods__, cls


def test_every_public_name_is_listed_by_dir_and_resolves():
    """The lazily loaded names (the Hugging Face integrations) too, for tab completion."""
    listed = dir(hf_zero)
    for name in hf_zero.__all__:
        assert name in listed, name
        assert getattr(hf_zero, name) is not None, name
