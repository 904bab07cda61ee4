"""ZeRO-3 entered below the model passed to `initialize`: direct calls of the input embeddings,
the encoder, the head or one layer's MLP, T5's and a PEFT model's ``generate()`` (ranks that
stop generating at different lengths included), and training whose loss goes through such
calls. Each is compared with the same model unsharded, trained as DDP trains it (gradients
averaged over the ranks) in the same processes. fp32 throughout: outputs must be equal, and
trained parameters within 1e-6 relative (summation order only, as in test_parity.py).
"""

import copy

import torch
import torch.distributed as dist
from helpers import batch, build_model, lora_engine, lora_model, still_gathered

import hf_zero
from hf_zero.testing import run_distributed

ZERO3 = dict(param_persistence_threshold=50)  # norms stay whole; every matrix is sharded
TOL = 1e-6


def _tiny_t5() -> torch.nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(
        vocab_size=97,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    return T5ForConditionalGeneration(config).eval()  # no dropout: outputs compared exactly


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def _direct_calls() -> dict:
    rank = dist.get_rank()
    reference, model = build_model(), build_model()
    engine = hf_zero.initialize(model, torch.optim.AdamW(model.parameters()), stage=3, **ZERO3)
    ids = batch(rank, 0, 0)
    out = {}
    with torch.no_grad():
        out["embeddings"] = _diff(
            model.get_input_embeddings()(ids), reference.get_input_embeddings()(ids)
        )
        out["root_kept_after_a_call_below_it"] = bool(still_gathered(engine))
        hidden = torch.randn(2, 5, 40, generator=torch.Generator().manual_seed(rank))
        out["head"] = _diff(model.lm_head(hidden), reference.lm_head(hidden))
        out["inner_model"] = _diff(
            model.model(input_ids=ids).last_hidden_state,
            reference.model(input_ids=ids).last_hidden_state,
        )
        out["one_layers_mlp"] = _diff(
            model.model.layers[1].mlp(hidden), reference.model.layers[1].mlp(hidden)
        )
        model(input_ids=ids)  # a full forward ends by releasing everything
        out["after_full_forward"] = still_gathered(engine)

        t5_reference = _tiny_t5()
        t5 = copy.deepcopy(t5_reference)
        hf_zero.initialize(t5, torch.optim.AdamW(t5.parameters()), stage=3, **ZERO3)
        t5_ids = ids[:, :7] % 97
        out["t5_encoder"] = _diff(
            t5.get_encoder()(input_ids=t5_ids).last_hidden_state,
            t5_reference.get_encoder()(input_ids=t5_ids).last_hidden_state,
        )
        new = 3 + 5 * rank  # ranks stop generating at different lengths
        tokens = t5.generate(t5_ids, max_new_tokens=new, do_sample=False)
        expected = t5_reference.generate(t5_ids, max_new_tokens=new, do_sample=False)
        out["t5_generate"] = torch.equal(tokens, expected) and tokens.shape[1] == new + 1
    return out


def test_calls_below_the_root_gather_what_they_need():
    for r in run_distributed(_direct_calls, 2):
        for key in ("embeddings", "head", "inner_model", "one_layers_mlp", "t5_encoder"):
            assert r[key] == 0.0, (key, r)
        assert r["root_kept_after_a_call_below_it"], r
        assert r["after_full_forward"] == [], r
        assert r["t5_generate"], r


def _average_grads(model: torch.nn.Module) -> None:
    """What DDP does to the gradients in backward."""
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


def _loss_through_direct_calls(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    embeds = model.get_input_embeddings()(ids)
    hidden = model.model(inputs_embeds=embeds).last_hidden_state
    logits = model.get_output_embeddings()(hidden)
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def _train_through_direct_calls() -> dict:
    rank = dist.get_rank()
    reference, model = build_model(), build_model()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    engine = hf_zero.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=3, **ZERO3
    )
    losses = []
    for step in range(3):
        ids = batch(rank, step, 0)
        ref_loss = _loss_through_direct_calls(reference, ids)
        ref_loss.backward()
        _average_grads(reference)
        ref_opt.step()
        ref_opt.zero_grad()
        loss = _loss_through_direct_calls(model, ids)
        engine.backward(loss)
        engine.step()
        losses.append(abs(loss.item() - ref_loss.item()))
    left = still_gathered(engine)
    with torch.no_grad():
        ids = batch(rank, 9, 0)
        after = _diff(
            model.lm_head(model.model(ids)[0]), reference.lm_head(reference.model(ids)[0])
        )
    return {"loss": max(losses), "outputs_after_training": after, "gathered_after_step": left}


def test_training_through_calls_below_the_root_matches_ddp():
    for r in run_distributed(_train_through_direct_calls, 2):
        assert r["loss"] <= TOL and r["outputs_after_training"] <= 1e-5, r
        assert r["gathered_after_step"] == [], r  # a copy gathered before a step is stale


def _peft_generate_after_training() -> dict:
    rank = dist.get_rank()
    reference, model = lora_model(), lora_model()
    trainable = [p for p in reference.parameters() if p.requires_grad]
    ref_opt = torch.optim.AdamW(trainable, lr=3e-3)
    engine = lora_engine(model, **ZERO3)
    for step in range(2):
        ids = batch(rank, step, 0)
        ref_loss = reference(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        _average_grads(reference)
        ref_opt.step()
        ref_opt.zero_grad()
        engine.backward(model(input_ids=ids, labels=ids).loss)
        engine.step()
    model.eval()
    reference.eval()
    prompt = batch(rank, 5, 0)[:, :6]
    new = 4 + 5 * rank
    with torch.no_grad():
        tokens = model.generate(input_ids=prompt, max_new_tokens=new, do_sample=False)
        expected = reference.generate(input_ids=prompt, max_new_tokens=new, do_sample=False)
    return {"same": torch.equal(tokens, expected), "new": tokens.shape[1] - prompt.shape[1]}


def test_peft_generate_under_stage3_equals_the_unsharded_model(tmp_path):
    for rank, r in enumerate(run_distributed(_peft_generate_after_training, 2)):
        assert r["same"] and r["new"] == 4 + 5 * rank, r
