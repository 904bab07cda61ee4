"""Long sequences: Ulysses sequence parallelism, tiled logits and tiled MLP, each exact.

* SP 2 (2 ranks) and SP 4 / SP 2 x DP 2 (4 ranks) against one process training the same global
  batch in the same run, fp32, AdamW: per-step loss and every parameter within 1e-5 (norm-wise
  relative; only the order of partial sums differs). Batches carry padding, ignored labels
  (-100), packed rows (position_ids restarting inside a row), and sequence lengths that sp does
  not divide (padded); the model has GQA (4 query heads, 2 kv heads: at SP 4 each kv head is
  repeated) and tied embeddings; stages 0 and 3, optimizer offload, gradient checkpointing, LoRA;
  Qwen3 (q/k norms) and Mistral with eager attention and a sliding window shorter than the rows.
* Tiled logits (tiles of 5 tokens) and tiled MLP against the untiled run at stage 3: loss 1e-6,
  parameters 1e-5 (norm-wise relative). A weight gradient summed over tiles differs from the one
  matmul's by fp32 rounding (~1e-7 relative, more or less by CPU kernel), and AdamW's division by
  sqrt(v) magnifies it where a gradient element is near zero: 3.6e-6 after 3 steps on an AVX2 CPU.
* Checkpoint offload: the same path on CPU, so bit-identical to checkpointing without it.
* The Trainer: ``run_clm.py`` under ``-m hf_zero.run --zero_sp_size 2`` on 2 processes logs the
  losses of the same script on one process without SP.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from helpers import MODEL, ROOT, build_model, launch, lora_model, max_loss_diff, max_param_diff

import hf_zero
from hf_zero.config.zero_config import ZeroConfig
from hf_zero.sequence.offload import OffloadedCheckpoint
from hf_zero.testing import run_distributed
from hf_zero.tiny import TINY_DECODER, tiny_qwen3

TOL = 1e-5
STEPS = 3


def _batches(kind: str, data_ranks: int, length: int = 12) -> list[list[dict]]:
    """Per step, one batch per data-parallel rank."""
    g = torch.Generator().manual_seed(5)
    steps = []
    for _ in range(STEPS):
        per_rank = []
        for _ in range(data_ranks):
            ids = torch.randint(0, MODEL["vocab_size"], (2, length), generator=g)
            labels = ids.clone()
            labels[:, :3] = -100  # a prompt that is not trained on
            batch = dict(input_ids=ids, labels=labels)
            if kind == "packed":  # three sequences in row 0, two in row 1
                row0 = [*range(4), *range(5), *range(length - 9)]
                row1 = [*range(7), *range(length - 7)]
                batch["position_ids"] = torch.tensor([row0, row1])
            else:  # right padding in row 1
                mask = torch.ones(2, length, dtype=torch.long)
                mask[1, -4:] = 0
                labels[1, -4:] = -100
                batch["attention_mask"] = mask
            per_rank.append(batch)
        steps.append(per_rank)
    return steps


def _reference(build, steps: list[list[dict]]) -> tuple[list[float], dict]:
    """One process: the mean of the data-parallel ranks' losses, AdamW."""
    model = build()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    losses = []
    for per_rank in steps:
        loss = sum(model(**b).loss for b in per_rank) / len(per_rank)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(build, steps, data_rank: int, probe=None, **cfg) -> tuple[list[float], dict]:
    model = build()
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine = hf_zero.initialize(model, torch.optim.AdamW(trainable, lr=1e-3), **cfg)
    if probe is not None:
        probe(model)
    losses = []
    for per_rank in steps:
        batch = {k: v.clone() for k, v in per_rank[data_rank].items()}
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        # Every rank reports its sequence-parallel group's whole loss; the step's is their mean.
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / torch.distributed.get_world_size())
    if cfg.get("sp_size", 1) > 1 and not getattr(model, "is_activation_checkpointing", False):
        # Per step and layer: q, k, v and the output exchanged in forward, and again in backward
        calls = engine.comm_stats.call_count(kind="all_to_all", purpose="sp")
        assert calls == STEPS * MODEL["num_hidden_layers"] * 8, calls
    full = engine.full_state_dict(rank0_only=False)
    names = [n for n, _ in model.named_parameters()]
    return losses, {n: full[n] for n in names if n in full}


BUILDERS = {
    "tiny": lambda: build_model(0),
    "checkpointed": lambda: build_model(0, checkpointing=True),
    "lora": lambda: lora_model(0),
    "qwen3": lambda: tiny_qwen3(0),
    "mistral-eager": lambda: _mistral(),
}


def _mistral() -> torch.nn.Module:
    """Eager attention (an additive mask) and a sliding window shorter than the sequence."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(**{**TINY_DECODER, "sliding_window": 5}, attn_implementation="eager")
    return MistralForCausalLM(config)


CASES_2 = [  # (model, batches, config)
    ("tiny", "padded", dict(stage=0)),
    ("tiny", "packed", dict(stage=3)),  # a KV cache: transformers attends across the sequences
    ("checkpointed", "packed", dict(stage=3)),  # no cache: each sequence alone
    ("checkpointed", "padded", dict(stage=3, offload_optimizer="cpu")),
    ("checkpointed", "packed", dict(stage=3, offload_checkpoints=True)),
    ("tiny", "uneven", dict(stage=2)),
    ("lora", "packed", dict(stage=3)),
    ("qwen3", "padded", dict(stage=3)),
    ("mistral-eager", "padded", dict(stage=1)),
]


def _sp_matches_one_process(sp: int, cases) -> list[tuple[str, float, float]]:
    world = torch.distributed.get_world_size()
    data_ranks = world // sp
    data_rank = torch.distributed.get_rank() // sp
    results = []
    for name, kind, cfg in cases:
        steps = _batches(kind, data_ranks, length=11 if kind == "uneven" else 12)
        ref_losses, ref_params = _reference(BUILDERS[name], steps)
        losses, params = _train(BUILDERS[name], steps, data_rank, sp_size=sp, **cfg)
        params = {n: params[n] for n in ref_params if n in params}
        results.append(
            (
                f"{name}/{kind}/{cfg}",
                max_loss_diff(losses, ref_losses),
                max_param_diff(params, {n: ref_params[n] for n in params}),
            )
        )
    return results


def _check(results) -> None:
    for rank_results in results:
        for label, loss_diff, param_diff in rank_results:
            assert loss_diff < TOL and param_diff < TOL, (label, loss_diff, param_diff)


def test_sp2_matches_one_process():
    _check(run_distributed(_sp_matches_one_process, 2, (2, CASES_2), timeout=300))


@pytest.mark.slow
def test_sp4_and_sp2_dp2_match_one_process():
    cases = [("tiny", "padded", dict(stage=3)), ("tiny", "packed", dict(stage=1))]
    _check(run_distributed(_sp_matches_one_process, 4, (4, cases), timeout=300))
    _check(run_distributed(_sp_matches_one_process, 4, (2, cases), timeout=300))


def _evaluation_sees_whole_logits() -> tuple[float, float, tuple]:
    """Without gradients (evaluation, metrics) every rank gets the whole sequence's logits,
    the padding that made sp divide the length dropped."""
    batch = _batches("padded", 1, length=11)[0][0]
    reference = BUILDERS["tiny"]().eval()
    with torch.no_grad():
        expected = reference(**batch)
    model = BUILDERS["tiny"]()
    engine = hf_zero.initialize(model, torch.optim.AdamW(model.parameters()), stage=3, sp_size=2)
    engine.eval()
    with torch.no_grad():
        out = engine(**{k: v.clone() for k, v in batch.items()})
    diff = (out.logits - expected.logits).abs().max().item()
    return diff, abs(out.loss.item() / expected.loss.item() - 1), tuple(out.logits.shape)


def test_evaluation_under_sp_returns_the_whole_logits():
    for diff, loss_diff, shape in run_distributed(_evaluation_sees_whole_logits, 2):
        assert shape == (2, 11, MODEL["vocab_size"]), shape
        assert diff < TOL and loss_diff < TOL, (diff, loss_diff)


def _rows_apart(steps: list[list[dict]]) -> list[list[dict]]:
    """The same steps with each row of the one batch on its own data-parallel rank."""
    return [
        [{k: v[r : r + 1] for k, v in per_rank[0].items()} for r in range(2)] for per_rank in steps
    ]


def _quantized_bases_match(path: str) -> list[tuple[str, float, float]]:
    """MixZ++ (its INT8 frozen shards depend on how the base is sharded) under SP 2 equals the
    same 2 ranks as data-parallel ranks, one row each; an NF4 base (QLoRA) equals one process.
    Both rows train on as many tokens, so the mean of the ranks' means is the whole mean."""
    from helpers import load_quantized

    steps = _batches("packed", 1)
    rank = torch.distributed.get_rank()
    mixz = dict(stage=3, quantized_nontrainable_weights=True)
    sp = _train(BUILDERS["lora"], steps, 0, sp_size=2, **mixz)
    dp = _train(BUILDERS["lora"], _rows_apart(steps), rank, **mixz)
    results = [("mixz", max_loss_diff(sp[0], dp[0]), max_param_diff(sp[1], dp[1]))]

    def qlora():
        return load_quantized(path, "nf4-bf16", dtype=torch.float32)

    ref_losses, ref_params = _reference(qlora, steps)
    losses, params = _train(qlora, steps, 0, sp_size=2, stage=3)
    trained = {n: params[n] for n in ref_params if "lora_" in n}
    ref = {n: ref_params[n] for n in trained}
    results.append(("qlora", max_loss_diff(losses, ref_losses), max_param_diff(trained, ref)))
    return results


def test_sp2_with_mixz_and_a_qlora_base(tmp_path):
    from helpers import QLORA_MODEL

    from hf_zero.tiny import tiny_llama

    path = str(tmp_path / "base")
    config = {**QLORA_MODEL, "vocab_size": MODEL["vocab_size"]}
    tiny_llama(0, initializer_range=0.2, **config).save_pretrained(path)
    _check(run_distributed(_quantized_bases_match, 2, (path,), timeout=300))


def _tiled_matches_untiled(name: str) -> list[tuple[str, float, float]]:
    steps = _batches("padded", 2)
    data_rank = torch.distributed.get_rank()
    plain = _train(BUILDERS[name], steps, data_rank, stage=3, tiled_logits=False)
    results = []
    for cfg, module in (
        (dict(tiled_logits=True, logits_tile_tokens=5), "lm_head"),
        (dict(tiled_logits=False, tiled_mlp=True, mlp_tile_tokens=5), "layers.0.mlp.gate_proj"),
    ):
        calls = []

        def count_calls(model, module=module, calls=calls):
            target = next(m for n, m in model.named_modules() if n.endswith(module))
            target.register_forward_hook(lambda *_: calls.append(1))

        losses, params = _train(BUILDERS[name], steps, data_rank, count_calls, stage=3, **cfg)
        # 24 tokens a batch: 5 logits tiles, the last all ignored labels (skipped), each run
        # again in backward; 12 tokens a row: 3 MLP tiles, each recomputed
        assert len(calls) == STEPS * (8 if module == "lm_head" else 6), (cfg, len(calls))
        results.append(
            (str(cfg), max_loss_diff(losses, plain[0]), max_param_diff(params, plain[1]))
        )
    return results


@pytest.mark.parametrize("name", ["tiny", "lora"])
def test_tiled_logits_and_mlp_match_untiled(name):
    for rank_results in run_distributed(_tiled_matches_untiled, 2, (name,), timeout=300):
        for label, loss_diff, param_diff in rank_results:
            assert loss_diff < 1e-6 and param_diff < TOL, (label, loss_diff, param_diff)


def _tiles_differ_across_ranks() -> list[tuple[str, float, float]]:
    """Stage 3 with data-parallel ranks whose batches make different numbers of tiles (rank 0
    16 tokens, rank 1 8; then rank 1 with its last tiles all ignored labels, which are
    skipped): every rank still runs the same collectives."""
    rank = torch.distributed.get_rank()
    g = torch.Generator().manual_seed(rank)
    results = []
    for kind in ("lengths", "ignored"):
        ids = torch.randint(
            0, MODEL["vocab_size"], (1, 16 if rank == 0 or kind == "ignored" else 8), generator=g
        )
        labels = ids.clone()
        if kind == "ignored" and rank == 1:
            labels[:, 6:] = -100
        steps = [[dict(input_ids=ids, labels=labels)] * 2] * STEPS
        plain = _train(BUILDERS["tiny"], steps, rank, stage=3, tiled_logits=False)
        tiles = dict(logits_tile_tokens=4, tiled_mlp=True, mlp_tile_tokens=4)
        tiled = _train(BUILDERS["tiny"], steps, rank, stage=3, tiled_logits=True, **tiles)
        results.append(
            (kind, max_loss_diff(tiled[0], plain[0]), max_param_diff(tiled[1], plain[1]))
        )
    return results


def test_tiles_that_differ_across_ranks_match_untiled():
    for rank_results in run_distributed(_tiles_differ_across_ranks, 2, timeout=300):
        for label, loss_diff, param_diff in rank_results:
            assert loss_diff < 1e-6 and param_diff < TOL, (label, loss_diff, param_diff)


def test_sequence_settings_are_checked():
    with pytest.raises(ValueError, match="'sp_size' = 2 with 'tp_size' = 2"):
        ZeroConfig(sp_size=2, tp_size=2)
    with pytest.raises(ValueError, match="'tiled_logits' = 'sometimes' is not allowed"):
        ZeroConfig(tiled_logits="sometimes")
    with pytest.raises(ValueError, match="'sp_size' = 3 must divide the number of processes"):
        ZeroConfig(sp_size=3).check_world(2)
    assert ZeroConfig.load({"sequence_parallel_size": 2}).sp_size == 2  # DeepSpeed's key


def _heads_refused():
    model = build_model(0, num_attention_heads=4, num_key_value_heads=4, hidden_size=40)
    hf_zero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), sp_size=2)
    model3 = build_model(0, num_attention_heads=5, num_key_value_heads=5, hidden_size=40)
    try:
        hf_zero.initialize(model3, torch.optim.SGD(model3.parameters(), lr=0.1), sp_size=2)
    except ValueError as error:
        return str(error)
    return None


def test_heads_sp_does_not_divide_are_refused():
    messages = run_distributed(_heads_refused, 2, timeout=120)
    assert all("'sp_size' = 2 must divide the model's attention heads (5)" in m for m in messages)


def _trainer_run(tmp_path, name: str, launcher: list[str], *flags: str) -> list[float]:
    out = tmp_path / name
    cmd = [*launcher, "-m", "hf_zero.run", str(ROOT / "recipes/examples/run_clm.py")]
    cmd += ["--output_dir", str(out), "--do_train", "--max_steps", "4", "--report_to", "none"]
    cmd += ["--per_device_train_batch_size", "2", "--logging_steps", "1", "--disable_tqdm", "true"]
    cmd += ["--save_strategy", "no", "--zero_stage", "3", *flags]
    launch(cmd, launcher=(), timeout=400)
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return [e["loss"] for e in history if "loss" in e]


def test_trainer_with_sp2_logs_the_one_process_losses(tmp_path):
    """transformers' run_clm, unmodified."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node"]
    alone = _trainer_run(tmp_path, "alone", [*torchrun, "1"])
    sp = _trainer_run(tmp_path, "sp", [*torchrun, "2"], "--zero_sp_size", "2")
    assert len(sp) == len(alone) == 4
    assert max_loss_diff(sp, alone) < TOL, (sp, alone)


def _sft_run(tmp_path, name: str, processes: str, *flags: str) -> list[dict]:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", processes]
    cmd = [*torchrun, "-m", "hf_zero.run", str(ROOT / "recipes/examples/sft.py")]
    cmd += ["--output_dir", str(tmp_path / name), "--max_steps", "4", "--report_to", "none"]
    cmd += ["--bf16", "false", "--zero_stage", "3", "--per_device_train_batch_size", "2"]
    cmd += ["--logging_steps", "1", "--disable_tqdm", "true", "--save_strategy", "no", *flags]
    launch(cmd, launcher=(), timeout=400)
    history = json.loads((tmp_path / name / "trainer_state.json").read_text())["log_history"]
    return [e for e in history if "loss" in e]


def test_trl_sft_with_sp2_logs_the_one_process_losses(tmp_path):
    """TRL's SFTTrainer, unmodified: it sums the fused LM head's per-token log-probabilities into
    the loss itself, outside the model; joined over the group they are the whole sequence's, so
    the losses, gradient norms and TRL's token metrics equal one process's."""
    alone = _sft_run(tmp_path, "alone", "1")
    sp = _sft_run(tmp_path, "sp", "2", "--zero_sp_size", "2")
    assert len(sp) == len(alone) == 4
    for key in ("loss", "grad_norm", "entropy", "mean_token_accuracy"):
        ours, reference = [e[key] for e in sp], [e[key] for e in alone]
        diff = max(abs(a - b) / max(abs(b), 1.0) for a, b in zip(ours, reference))
        assert diff < TOL, (key, ours, reference)
    assert alone[0]["loss"] != alone[-1]["loss"]


def _offload_matches_plain() -> tuple[list, list, float, str]:
    steps = _batches("padded", 2)
    rank = torch.distributed.get_rank()
    plain = _train(BUILDERS["checkpointed"], steps, rank, stage=3)
    wrapped = []

    def count(model):
        for module in model.modules():
            if isinstance(
                getattr(module, "_gradient_checkpointing_func", None), OffloadedCheckpoint
            ):
                wrapped.append(module)

    offloaded = _train(
        BUILDERS["checkpointed"], steps, rank, count, stage=3, offload_checkpoints=True
    )
    assert len(wrapped) == MODEL["num_hidden_layers"], wrapped
    model = build_model(0)  # no checkpointing: nothing to offload
    refused = ""
    try:
        hf_zero.initialize(
            model, torch.optim.SGD(model.parameters(), lr=0.1), offload_checkpoints=True
        )
    except ValueError as error:
        refused = str(error)
    return plain[0], offloaded[0], max_param_diff(offloaded[1], plain[1]), refused


def test_checkpoint_offload_is_exact_on_cpu():
    for plain, offloaded, param_diff, refused in run_distributed(_offload_matches_plain, 2):
        assert offloaded == plain and param_diff == 0.0
        assert "'offload_checkpoints' = true needs activation checkpointing on" in refused


def test_estimated_logits_match_what_autograd_keeps():
    """`hf-zero estimate`'s logits figure against the bytes autograd saves, measured, on a model
    whose logits dominate (vocabulary 16384, hidden 16): untiled within 10%; tiled, a tenth."""
    from hf_zero.memory import sequence_bytes, shape_of
    from hf_zero.profiling.activations import SavedTensorMeter
    from hf_zero.sequence import tiles

    model = build_model(0, vocab_size=16384, hidden_size=16, intermediate_size=32,
                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)  # fmt: skip
    ids = torch.randint(0, 16384, (1, 512), generator=torch.Generator().manual_seed(0))
    saved = {}
    for tiled in (False, True):
        meter = SavedTensorMeter()
        meter.enter()
        if tiled:
            out = model.model(input_ids=ids).last_hidden_state
            shift = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:]
            loss = tiles.tiled_loss(out, model.lm_head, shift, None, 64)
        else:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        meter.exit()
        saved[tiled] = meter.peak
        loss.backward()
    predicted = sequence_bytes(shape_of(model), 512, 1, "fp32")
    assert abs(saved[False] - predicted["total"]) < 0.1 * predicted["total"], (saved, predicted)
    assert saved[True] < 0.1 * saved[False], saved


def _auto_tiling() -> tuple[int, bool, bool]:
    import hf_zero.sequence as sequence

    sequence.AUTO_TILE_LOGITS_BYTES = 10_000  # so that this tiny model's batch is "large"
    model = build_model(0)
    engine = hf_zero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))
    calls = []
    model.lm_head.register_forward_hook(lambda *_: calls.append(1))
    ids = torch.randint(0, MODEL["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))
    train = engine(input_ids=ids, labels=ids)  # 24 x 251 x 4 bytes > 10 000: tiled
    with torch.no_grad():
        evaluation = engine(input_ids=ids, labels=ids)
    return len(calls), train.logits is None, evaluation.logits is not None


def test_auto_tiles_training_forwards_with_large_logits_only():
    forward_calls, train_has_no_logits, eval_logits = run_distributed(_auto_tiling, 1)[0]
    # training: one tile (24 tokens x 251 x 4 bytes is within a 64 MiB tile); evaluation: one
    assert (forward_calls, train_has_no_logits, eval_logits) == (2, True, True)
