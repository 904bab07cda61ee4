"""Bad input fails early with a message that names the problem (no process group needed)."""

import pytest
import torch
import torch.distributed as dist
from transformers.optimization import Adafactor

import hf_zero
from hf_zero.tiny import tiny_llama


class HomeMadeSGD(torch.optim.Optimizer):
    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad, alpha=-group["lr"])


@pytest.fixture
def single_rank():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_non_elementwise_optimizer_is_refused(single_rank):
    model = tiny_llama()
    with pytest.raises(ValueError, match="Adafactor is not elementwise"):
        hf_zero.initialize(
            model, Adafactor(model.parameters(), lr=1e-3, relative_step=False), stage=2
        )
    assert not dist.is_initialized(), "the error must come before any process-group work"


def test_unverified_optimizer_needs_explicit_permission(single_rank):
    model = tiny_llama()
    with pytest.raises(ValueError, match="allow_untested_optimizer"):
        hf_zero.initialize(model, HomeMadeSGD(model.parameters()), stage=1)
    engine = hf_zero.initialize(
        model, HomeMadeSGD(model.parameters()), stage=1, allow_untested_optimizer=True
    )
    x = torch.randint(0, 256, (1, 8))
    engine.backward(engine(input_ids=x, labels=x).loss)
    assert engine.step()


def test_optimizer_over_foreign_tensors_is_refused(single_rank):
    model = tiny_llama()
    stray = torch.nn.Parameter(torch.zeros(3, 5))
    with pytest.raises(ValueError, match=r"shape \(3, 5\) that is not a parameter of the model"):
        hf_zero.initialize(model, torch.optim.AdamW([*model.parameters(), stray]), stage=2)


def test_missing_optimizer_and_unfinished_features(single_rank):
    model = tiny_llama()
    with pytest.raises(ValueError, match="pass an optimizer"):
        hf_zero.initialize(model, None, stage=2)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="'tp_size' = 2 must divide the world size 1"):
        hf_zero.initialize(model, opt, stage=2, tp_size=2)
    with pytest.raises(ValueError, match="'offload_param' = 'cpu' needs 'stage' = 3; got stage 2"):
        hf_zero.initialize(model, opt, stage=2, offload_param="cpu")


def test_optimizer_from_deepspeed_section(single_rank):
    model = tiny_llama()
    cfg = {
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
    }
    engine = hf_zero.initialize(model, None, cfg)
    assert isinstance(engine.optimizer.optimizer, torch.optim.AdamW)
    assert engine.optimizer.optimizer.param_groups[0]["lr"] == 0.01
    assert engine.optimizer.optimizer.param_groups[0]["weight_decay"] == 0.0  # DeepSpeed's default
    unresolved = {
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
    }
    with pytest.raises(ValueError, match=r"'optimizer.params.lr' = 'auto', but there is nothing"):
        hf_zero.initialize(tiny_llama(), None, unresolved)


def test_fp16_requires_engine_backward(single_rank):
    model = tiny_llama()
    engine = hf_zero.initialize(model, torch.optim.AdamW(model.parameters()), precision="fp16")
    x = torch.randint(0, 256, (1, 8))
    with pytest.raises(RuntimeError, match=r"call engine.backward\(loss\)"):
        engine(input_ids=x, labels=x).loss.backward()


def test_a_parameter_left_on_meta_is_named(single_rank):
    with torch.device("meta"):
        model = tiny_llama()
    with pytest.raises(ValueError, match=r"on the meta device .*'model.embed_tokens.weight'"):
        hf_zero.initialize(model, torch.optim.AdamW(model.parameters()), stage=2)


def test_an_all_frozen_model_and_a_step_before_backward_say_so(single_rank):
    model = tiny_llama()
    engine = hf_zero.initialize(model, torch.optim.AdamW(model.parameters()), stage=2)
    with pytest.warns(UserWarning, match=r"engine.step\(\) before any backward"):
        assert engine.step() is False
    engine.close()
    frozen = tiny_llama().requires_grad_(False)
    engine = hf_zero.initialize(frozen, torch.optim.AdamW(frozen.parameters()), stage=2)
    x = torch.randint(0, 256, (1, 8))
    with pytest.raises(RuntimeError, match="no trainable parameter was used"):
        engine.backward(engine(input_ids=x, labels=x).loss)
