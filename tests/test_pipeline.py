"""Pipeline parallelism, first part (issue 19): stages cut from a Hugging Face Llama, run by
`torch.distributed.pipelining`'s schedules on gloo, against the unsplit model in the same run.

The schedules average the micro-batch losses' gradients (``scale_grads``), so the reference is
the mean of the same micro-batches' losses through the whole model, one backward. Losses are
equal bit for bit, micro-batch by micro-batch; gradients to 1e-6 (measured up to 4e-9): the
schedules accumulate the micro-batches' gradients one backward at a time, the reference in one
backward over their sum, so the same terms are added in another order (with tied embeddings the
two copies' gradients are also summed across the first and last stage).
"""

import copy

import pytest
import torch
import torch.distributed as dist
from helpers import MODEL, build_model
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from hf_zero.pipeline import partition_layers, split_causal_lm
from hf_zero.pipeline.split import CausalLMStage, sync_tied_grads
from hf_zero.testing import run_distributed

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": None}
MICRO, SEQ = 4, 12
TOL = 1e-6


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The causal-LM loss the Hugging Face models compute (shifted, -100 ignored, fp32)."""
    logits = logits[:, :-1].float().reshape(-1, logits.shape[-1])
    return torch.nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1), ignore_index=-100)


def _data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, MODEL["vocab_size"], (MICRO * 2, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding in one sample: the mask must reach every stage
    mask[6, :5] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def _run(schedule: str, pp: int, layers: int, tied: bool, virtual: int = 1) -> dict:
    rank = dist.get_rank()
    model = build_model(0, num_hidden_layers=layers, tie_word_embeddings=tied)
    reference = copy.deepcopy(model)
    ids, mask, labels = _data()
    n_stages = pp * virtual
    mine = [s for s in range(n_stages) if s % pp == rank]  # looped placement (interleaved)
    stages = [split_causal_lm(model, n_stages, s, "uniform") for s in mine]
    pipes = [PipelineStage(m, s, n_stages, torch.device("cpu")) for m, s in zip(stages, mine)]
    if virtual > 1:
        runner = ScheduleInterleaved1F1B(pipes, n_microbatches=MICRO, loss_fn=lm_loss)
    else:
        runner = SCHEDULES[schedule](pipes[0], n_microbatches=MICRO, loss_fn=lm_loss)
    losses: list[torch.Tensor] = []
    is_last = (n_stages - 1) in mine
    if 0 in mine:
        runner.step(ids, attention_mask=mask, target=labels if is_last else None, losses=losses)
    else:
        runner.step(target=labels if is_last else None, losses=losses)
    if tied:
        ends = dist.new_group([0, (n_stages - 1) % pp])
        for stage in stages:
            if stage.first or stage.last:
                sync_tied_grads(stage, ends)
    ref_losses = [
        lm_loss(reference(input_ids=i, attention_mask=m).logits, t)
        for i, m, t in zip(ids.chunk(MICRO), mask.chunk(MICRO), labels.chunk(MICRO))
    ]
    (sum(ref_losses) / MICRO).backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    diffs = {}
    for stage in stages:
        for name, p in _named(stage, model):
            if p.grad is None or ref_grads[name] is None:
                raise AssertionError(f"{name}: no gradient (stage {p.grad}, whole model)")
            diffs[name] = (p.grad - ref_grads[name]).abs().max().item()
    return {
        "losses": [x.item() for x in losses],
        "ref_losses": [x.item() for x in ref_losses],
        "max_grad_diff": max(diffs.values()),
        "params": sorted(diffs),
    }


def _named(stage: CausalLMStage, model) -> list[tuple[str, torch.nn.Parameter]]:
    """The stage's trainable parameters under the whole model's names (a tied head's copy under
    the embedding's name; helpers.build_model freezes one norm weight)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = [(names[id(p)], p) for p in stage.parameters() if id(p) in names and p.requires_grad]
    if stage.last and stage.tied and not stage.first:
        out.append(("model.embed_tokens.weight", stage.lm_head.weight))
    return out


def _check(results: list[dict], layers: int, tol: float, tied: bool = False) -> None:
    covered = set().union(*(r["params"] for r in results))
    model = build_model(0, num_hidden_layers=layers, tie_word_embeddings=tied)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert covered == trainable  # every trainable parameter is on some stage
    last = [r for r in results if r["losses"]]
    for r in last:
        assert r["losses"] == r["ref_losses"]  # bit for bit, every micro-batch
    for r in results:
        assert r["max_grad_diff"] <= tol, r["max_grad_diff"]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_stages_equal_the_whole_model(schedule):
    _check(run_distributed(_run, 2, args=(schedule, 2, 2, False)), 2, TOL)


@pytest.mark.slow
def test_four_stages_1f1b_and_interleaved_equal_the_whole_model():
    _check(run_distributed(_run, 4, args=("1f1b", 4, 4, False)), 4, TOL)
    _check(run_distributed(_run, 2, args=("interleaved", 2, 4, False, 2)), 4, TOL)


def test_tied_embeddings_sum_their_gradients_across_first_and_last_stage():
    _check(run_distributed(_run, 2, args=("1f1b", 2, 2, True)), 2, TOL, tied=True)


def test_partitions():
    assert partition_layers([1] * 7, 3, "uniform") == [range(0, 3), range(3, 5), range(5, 7)]
    assert partition_layers([1] * 6, 3, [1, 2, 3]) == [range(0, 1), range(1, 3), range(3, 6)]
    # Balanced by parameters: the embedding's weight on stage 0 earns it fewer layers.
    assert partition_layers([10] * 8, 2, "parameters", first_extra=40) == [
        range(0, 2),
        range(2, 8),
    ]
    assert partition_layers([5, 1, 1, 1, 1, 5], 2) == [range(0, 3), range(3, 6)]
    with pytest.raises(ValueError, match="pp_partition = 'even' is not allowed"):
        partition_layers([1] * 4, 2, "even")
    with pytest.raises(ValueError, match=r"pp_partition = \[1, 1\]: expected 2 positive"):
        partition_layers([1] * 4, 2, [1, 1])
    with pytest.raises(ValueError, match="pp_size = 5 must be between 1 and the 4"):
        partition_layers([1] * 4, 5)


def test_models_without_llama_layout_are_refused_clearly():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(NotImplementedError, match="GPT2LMHeadModel is not a Llama-family"):
        split_causal_lm(model, 2, 0)


# --- the engine: hf_zero.initialize(..., pp_size=N) and train_batch ---------------------------


def _train(pp: int, schedule: str, tied: bool, steps: int = 3) -> dict:
    import hf_zero

    model = build_model(0, num_hidden_layers=4, tie_word_embeddings=tied)
    reference = copy.deepcopy(model)
    engine = hf_zero.initialize(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        pp_size=pp,
        pp_schedule=schedule,
        pp_microbatches=MICRO,
        gradient_clipping=0.5,
    )
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    ids, mask, labels = _data()
    losses, ref_losses = [], []
    for step in range(steps):
        batch = {"input_ids": ids.roll(step, 0), "attention_mask": mask.roll(step, 0),
                 "labels": labels.roll(step, 0)}  # fmt: skip
        losses.append(engine.train_batch(batch))
        chunks = zip(*(t.chunk(MICRO) for t in batch.values()))
        micro = [lm_loss(reference(input_ids=i, attention_mask=m).logits, t) for i, m, t in chunks]
        loss = sum(micro) / MICRO
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
    evaluated = engine.eval_batch(batch)
    full = engine.full_state_dict()
    ref = dict(reference.named_parameters())
    diff = max(((full[n] - ref[n]).abs().max().item() for n in full), default=None)
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "eval": evaluated,
        "param_diff": diff,
        "names": sorted(full) == sorted(ref) if full else None,
        "topology": (engine.topology.pp_rank, engine.topology.dp_rank, engine.topology.tp_rank),
    }


@pytest.mark.parametrize(
    ("pp", "schedule", "tied"),
    [(2, "1f1b", True), (2, "gpipe", False), (2, "interleaved_1f1b", False)],
)
def test_train_batch_equals_single_process_training(pp, schedule, tied):
    results = run_distributed(_train, pp, args=(pp, schedule, tied))
    for rank, r in enumerate(results):
        assert r["topology"] == (rank, 0, 0)
        assert max(abs(a - b) for a, b in zip(r["losses"], r["ref_losses"])) <= TOL, r
        assert r["losses"] == results[0]["losses"]  # every rank returns the replica's loss
        assert r["eval"] > 0
    first = results[0]
    assert first["names"] is True and first["param_diff"] <= TOL, first["param_diff"]


@pytest.mark.slow
def test_train_batch_four_stages():
    results = run_distributed(_train, 4, args=(4, "1f1b", True))
    assert max(abs(a - b) for a, b in zip(results[0]["losses"], results[0]["ref_losses"])) <= TOL
    assert results[0]["param_diff"] <= TOL


def _attempt(cfg: dict) -> str:
    import hf_zero

    model = build_model(0)
    try:
        hf_zero.initialize(model, torch.optim.AdamW(model.parameters()), **cfg)
    except NotImplementedError as err:
        return str(err)
    return "accepted"


def test_pipeline_with_zero_or_data_parallel_is_refused_clearly():
    import hf_zero

    msgs = run_distributed(_attempt, 2, args=(dict(pp_size=2, stage=2),))
    assert "'stage' = 2 with pipeline stages is not implemented yet" in msgs[0]
    msgs = run_distributed(_attempt, 4, args=(dict(pp_size=2),))
    assert "'pp_size' = 2 on 4 processes" in msgs[0] and "data and tensor parallelism" in msgs[0]
    with pytest.raises(ValueError, match="'pp_schedule' = 'zb' is not allowed"):
        hf_zero.ZeroConfig(pp_schedule="zb").validate()
