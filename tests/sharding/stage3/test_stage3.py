"""ZeRO-3 against torch DDP in the same processes, plus what only stage 3 has to get right:
gathering for generate() and evaluation, activation checkpointing, memory held between steps,
communication volume, divergent control flow, and user access to whole parameters.

Tolerances as in test_parity.py: fp32 1e-6 relative (summation order only), bf16 1e-2.
"""

import json

import pytest
import torch
import torch.distributed as dist
from helpers import (
    BUCKET,
    batch,
    build_model,
    max_loss_diff,
    max_param_diff,
    still_gathered,
    train_ddp,
    train_zero,
    two_param_groups,
)

import hf_zero
from hf_zero.testing import run_distributed

STEPS = 3
CLIP = 0.3
FP32_TOL = 1e-6
BF16_TOL = 1e-2
# Norm weights (40 elements) stay whole; every matrix is sharded.
ZERO3 = dict(param_persistence_threshold=50)


def _parity(gas: int, checkpointing: bool, precision: str) -> dict:
    ref_losses, ref_params = train_ddp(
        STEPS, gas, CLIP, precision=precision, checkpointing=checkpointing
    )
    losses, params, engine = train_zero(
        STEPS, gas, CLIP, 3, precision=precision, checkpointing=checkpointing, **ZERO3
    )
    return {
        "loss": max_loss_diff(losses, ref_losses),
        "param": max_param_diff(params, ref_params),
        "units": len(engine.units),
        "sharded": sum(g.numel for u in engine.units for g in u.groups),
        "steps": engine.global_steps,
    }


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("gas", [1, 4])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["no-ckpt", "ckpt"])
def test_fp32_matches_ddp(world_size, gas, checkpointing):
    for r in run_distributed(_parity, world_size, args=(gas, checkpointing, "fp32")):
        assert r["units"] == 3 and r["sharded"] > 0 and r["steps"] == STEPS
        assert r["loss"] <= FP32_TOL, r
        assert r["param"] <= FP32_TOL, r


def _freed_mib() -> tuple[float, float | None]:
    """How much of 64 MiB of freed 4 MiB buffers left the process at once (VmRSS), and, to
    tell why when it is not what the policy says, how much glibc had served by ``mmap`` (its
    own count, ``mallinfo2().hblkhd``). Every other buffer of 32 is freed, so that no freed one
    joins the heap's top (which glibc trims); an 8 MiB buffer freed first raises glibc's
    dynamic mmap threshold above them, as a step's large frees do."""
    from hf_zero.profiling import process_memory
    from hf_zero.storage.host_memory import heap_info

    def rss() -> int:
        return process_memory.measured_bytes(torch.device("cpu"), allocator=False)["rss"]

    def mapped() -> int | None:
        info = heap_info()
        return None if info is None else int(info.hblkhd)

    del_me = torch.ones(2 << 20)
    del del_me
    buffers = [torch.ones(1 << 20) for _ in range(32)]
    full, full_mapped = rss(), mapped()
    del buffers[0::2]
    unmapped = None if full_mapped is None else (full_mapped - mapped()) / (1 << 20)
    return (full - rss()) / (1 << 20), unmapped


def _host_memory_policies() -> dict:
    from hf_zero.storage import host_memory

    trims, readings = [], []  # the trims, and the heap's free bytes each step's choice read
    original, read = host_memory.trim, host_memory.free_heap_bytes
    host_memory.trim = lambda: trims.append(1) or original()
    host_memory.free_heap_bytes = lambda: readings.append(read()) or readings[-1]
    ref_losses, ref_params = train_ddp(STEPS, 1, CLIP)
    out = {}
    for policy in ("release", "unmap", "reuse"):  # mallopt is process-wide: "reuse" last
        trims.clear()
        readings.clear()
        losses, params, _ = train_zero(STEPS, 1, CLIP, 3, host_memory=policy, **ZERO3)
        out[policy] = (max_loss_diff(losses, ref_losses), max_param_diff(params, ref_params))
        out[policy + "_trims"] = len(trims)
        out[policy + "_readings"] = len(readings)
        out[policy + "_enough"] = sum(
            f is None or f >= host_memory.TRIM_MIN_BYTES for f in readings
        )
        out[policy + "_freed_mib"], out[policy + "_unmapped_mib"] = _freed_mib()
    return out


def test_host_memory_policies_change_no_result_and_unmap_frees_inside_the_step():
    """``release`` and ``unmap`` look at the heap after each step and trim when it holds
    `TRIM_MIN_BYTES` free, ``reuse`` never; ``unmap`` returns each freed buffer of 1 MiB or more
    to the OS at once, where ``release`` and ``reuse`` keep them until a trim."""
    for r in run_distributed(_host_memory_policies, 2):
        assert r["release_readings"] == r["unmap_readings"] == STEPS, r
        assert r["release_trims"] == r["release_enough"] and r["reuse_trims"] == 0, r
        assert r["unmap_trims"] == r["unmap_enough"] + 1, r  # and once after the build
        freed = {k: v for k, v in r.items() if k.endswith("_mib")}
        assert r["unmap_freed_mib"] >= 60, freed
        assert r["release_freed_mib"] <= 8 and r["reuse_freed_mib"] <= 8, freed
        assert max(r["release"] + r["unmap"] + r["reuse"]) <= FP32_TOL, r


def test_bf16_matches_ddp_within_tolerance():
    for r in run_distributed(_parity, 2, args=(2, False, "bf16")):
        assert r["loss"] <= BF16_TOL and r["param"] <= BF16_TOL, r


# --- generation and evaluation ------------------------------------------------------------------


def _generate() -> dict:
    prompt = batch(0, 7, 0)[:, :6]
    reference = build_model()
    with torch.no_grad():
        ref_tokens = reference.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
        ref_loss = reference(input_ids=prompt, labels=prompt).loss.item()
    model = build_model()
    engine = hf_zero.initialize(model, torch.optim.AdamW(model.parameters()), stage=3, **ZERO3)
    model.eval()
    with torch.no_grad():
        tokens = model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
        loss = model(input_ids=prompt, labels=prompt).loss.item()
    return {
        "same_tokens": torch.equal(tokens, ref_tokens),
        "new_tokens": tokens.shape[1] - prompt.shape[1],
        "loss_diff": abs(loss - ref_loss),
        "still_gathered": still_gathered(engine),
    }


def test_generate_produces_the_unsharded_models_tokens():
    for r in run_distributed(_generate, 2):
        assert r["same_tokens"] and r["new_tokens"] == 12
        assert r["loss_diff"] == 0.0
        assert r["still_gathered"] == [], "evaluation left parameters gathered"


# --- memory and communication -------------------------------------------------------------------


def _memory_and_comm(checkpointing: bool) -> dict:
    model = build_model(checkpointing=checkpointing)
    engine = hf_zero.initialize(
        model,
        torch.optim.AdamW(two_param_groups(model)),
        stage=3,
        reduce_bucket_size=BUCKET,
        **ZERO3,
    )
    sharded = [g for g in engine.groups + engine.frozen_groups if g.stage == 3]
    replicated = [g for g in engine.groups if g.stage == 2]
    x = batch(dist.get_rank(), 0, 0)
    engine.backward(engine(input_ids=x, labels=x).loss)
    engine.step()
    state = engine.optimizer.optimizer.state
    root = engine.units[0]
    return {
        "rebuilt": engine.coordinator.saved.rebuilt,
        "report": engine.memory_report(),
        "stats": engine.comm_stats.as_dict(),
        "gathered": [g.names for g in sharded if g.flat_param is not None],
        "nonempty": [n for n, p in model.named_parameters() if p.numel() == 0] == [],
        "empty_sharded": all(p.numel() == 0 for g in sharded for p in g.params),
        "shard_numel": sum(g.layout.shard_numel for g in sharded),
        "sharded_padded": sum(g.numel for g in sharded),
        "sharded_trainable_padded": sum(g.numel for g in sharded if g.trainable),
        "root_padded": sum(g.numel for g in root.groups),
        "replicated_padded": sum(g.numel for g in replicated),
        "replicated_shard": sum(g.layout.shard_numel for g in replicated),
        "frozen_small": sum(
            p.numel() for p in model.parameters() if not p.requires_grad and p.numel() < 50
        ),
        "trainable_shard": sum(g.layout.shard_numel for g in engine.groups),
        "step_bytes": sum(s["step"].numel() * s["step"].element_size() for s in state.values()),
        "N": dist.get_world_size(),
    }


def _profiled_views(folder: str) -> dict:
    model = build_model()
    engine = hf_zero.initialize(
        model, torch.optim.AdamW(model.parameters()), stage=3, profile=True, profile_steps=1,
        profile_dir=folder, **ZERO3,
    )  # fmt: skip
    for step in range(2):  # the warm-up step, then the recorded one
        x = batch(dist.get_rank(), step, 0)
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
    return {"rebuilt": engine.coordinator.saved.rebuilt}


def test_profiling_leaves_the_saved_weight_views_to_stage_3(tmp_path):
    """Saved-tensor hooks do not nest in torch: the profiler's activation meter hands each saved
    tensor on to stage 3's hooks, so a profiled forward still saves weight views by place (and
    holds no unit's gathered buffer until its backward)."""
    for r in run_distributed(_profiled_views, 2, args=(str(tmp_path),)):
        assert r["rebuilt"] >= 2 * (7 * 2 + 1), r["rebuilt"]  # both steps, as unprofiled
    step = json.loads((tmp_path / "profile_rank0.json").read_text())["steps"][0]
    assert step["activation_peak"] > 0  # and the meter still counted the activations


@pytest.mark.parametrize("checkpointing", [False, True], ids=["no-ckpt", "ckpt"])
def test_memory_held_between_steps_and_comm_volume(checkpointing):
    for r in run_distributed(_memory_and_comm, 2, args=(checkpointing,)):
        rep, N = r["report"], r["N"]
        # Backward read the linear layers' saved weight views from its own gathers (forward's
        # buffers were not held by the graph: hf_zero.sharding.stage3.saved).
        # 7 linears per layer, 2 layers, the head; checkpointed layers save nothing in forward.
        assert r["rebuilt"] >= (1 if checkpointing else 7 * 2 + 1), r["rebuilt"]
        # Nothing stays gathered after a step; sharded parameters hold no data.
        assert r["gathered"] == [] and r["empty_sharded"]
        # Parameters: 1/N of the sharded ones (+ padding), plus the small replicated ones.
        assert r["shard_numel"] * N == r["sharded_padded"]
        assert rep["params"] == 4 * (r["shard_numel"] + r["replicated_padded"] + r["frozen_small"])
        # fp32 master weights alias the sharded parameters (and the replicated ones' own region
        # of their buffer); Adam state is 8 bytes per shard element.
        assert rep["master_weights"] == 0
        assert rep["optimizer_states"] - r["step_bytes"] == 8 * r["trainable_shard"]
        # Per step: every non-root unit gathered twice (forward, backward), the root once (it
        # stays gathered from the end of forward into backward), gradients reduce-scattered once;
        # the small replicated parameters follow stage 2 (reduce-scatter, all-gather after step).
        # Activation checkpointing recomputes while the unit is gathered: no extra traffic.
        ag, rs = r["stats"]["all_gather"]["bytes"], r["stats"]["reduce_scatter"]["bytes"]
        nonroot = r["sharded_padded"] - r["root_padded"]
        assert ag == 4 * (2 * nonroot + r["root_padded"] + r["replicated_padded"])
        assert rs == 4 * (r["sharded_trainable_padded"] + r["replicated_padded"])
        ratio = (ag + rs) / (4 * (r["sharded_padded"] + r["replicated_padded"]))
        assert 2.5 < ratio <= 3.0, ratio  # the ZeRO paper's 3x, less the root's saved gather


# --- plain torch models: reuse, frozen sharded weights, divergent control flow -----------------


class Reuse(torch.nn.Module):
    """A block called twice per forward, a frozen sharded layer, and an optional branch."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(16, 32)
        self.block = torch.nn.Linear(32, 32)
        self.frozen = torch.nn.Linear(32, 32)
        self.frozen.requires_grad_(False)
        self.branch = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, 1)

    def forward(self, x, use_branch: bool = False):
        h = torch.tanh(self.embed(x))
        h = torch.tanh(self.block(h))
        h = torch.tanh(self.frozen(h))
        h = torch.tanh(self.block(h))  # the same unit again
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.head(h).pow(2).mean()


def _reuse() -> dict:
    rank = dist.get_rank()
    out = {}
    for name in ("ddp", "zero"):
        torch.manual_seed(0)
        model = Reuse()
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=1e-2)
        if name == "ddp":
            runner = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
        else:
            runner = hf_zero.initialize(model, optimizer, stage=3, param_persistence_threshold=0)
            out["units"] = [u.name for u in runner.units]
            out["frozen_sharded"] = [g.names for g in runner.frozen_groups]
        for step in range(3):
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank))
            loss = runner(x)
            loss *= 1.0  # in place on the output, as the Trainer does: must stay legal
            loss.backward()
            optimizer.step() if name == "ddp" else runner.step()
            optimizer.zero_grad()
        with hf_zero.gathered_parameters(model.parameters()):
            out[name] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["param"] = max_param_diff(out.pop("zero"), out.pop("ddp"))
    return out


def test_module_called_twice_and_frozen_sharded_weights_match_ddp():
    for r in run_distributed(_reuse, 2):
        assert r["units"] == ["<root>", "embed", "block", "frozen", "branch", "head"]
        assert r["frozen_sharded"] == [["frozen.weight", "frozen.bias"]]
        assert r["param"] <= FP32_TOL, r


def _divergent() -> None:
    torch.manual_seed(0)
    model = Reuse()
    engine = hf_zero.initialize(
        model, torch.optim.AdamW(model.parameters()), stage=3, param_persistence_threshold=0
    )
    x = torch.randn(4, 16)
    engine(x, use_branch=dist.get_rank() == 0).backward()


def _divergent_later() -> None:
    """Same paths in the first step (the trace is agreed, later checks are read lazily), then
    rank 0 takes the branch in the third."""
    torch.manual_seed(0)
    model = Reuse()
    engine = hf_zero.initialize(
        model, torch.optim.AdamW(model.parameters()), stage=3, param_persistence_threshold=0
    )
    for step in range(3):
        x = torch.randn(4, 16)
        engine(x, use_branch=step == 2 and dist.get_rank() == 0).backward()
        engine.step()


@pytest.mark.parametrize("job", [_divergent, _divergent_later], ids=["first_step", "later_step"])
def test_rank_dependent_control_flow_raises_instead_of_hanging(job):
    with pytest.raises(AssertionError) as failure:
        run_distributed(job, 2, timeout=60)
    message = str(failure.value)
    assert "ranks took different paths through the model" in message
    assert "rank 0: forward of branch" in message and "rank 1: forward of head" in message
    assert "did not finish" not in message  # both ranks raised; nothing hung


# --- user access to whole parameters, and the full state dict -----------------------------------


def _gathered_and_state_dict() -> dict:
    rank = dist.get_rank()
    model = build_model()
    engine = hf_zero.initialize(model, torch.optim.AdamW(two_param_groups(model)), stage=3, **ZERO3)
    weight = model.get_parameter("model.layers.0.mlp.up_proj.weight")
    with hf_zero.gathered_parameters([weight], modifier_rank=0):
        if rank == 0:
            weight.data[0].fill_(0.5)  # surgery on one rank, published to all
    with hf_zero.gathered_parameters([weight]):
        row_everywhere = bool((weight[0] == 0.5).all())
        shape_inside = tuple(weight.shape)
    shape_outside = tuple(weight.shape)
    state = engine.full_state_dict()
    master = engine.full_state_dict(master_weights=True)
    x = batch(0, 3, 0)
    with torch.no_grad():
        logits = model(input_ids=x).logits  # every rank: the forward gathers collectively
    out = {
        "row": row_everywhere,
        "shapes": (shape_inside, shape_outside),
        "keys": len(state),
        "still_gathered": [
            g.names for g in engine.groups if g.stage == 3 and g.flat_param is not None
        ],
    }
    if rank == 0:
        name = "model.layers.0.mlp.up_proj.weight"
        out["state_row"] = bool((state[name][0] == 0.5).all())
        out["master_row"] = bool((master[name][0] == 0.5).all())
        fresh = build_model(seed=5)
        fresh.load_state_dict(state)
        with torch.no_grad():
            out["logits_equal"] = torch.equal(fresh(input_ids=x).logits, logits)
        out["tied"] = state["lm_head.weight"].data_ptr() != 0 and torch.equal(
            state["lm_head.weight"], state["model.embed_tokens.weight"]
        )
    return out


def test_gathered_parameters_and_full_state_dict():
    rank0, rank1 = run_distributed(_gathered_and_state_dict, 2)
    for r in (rank0, rank1):
        assert r["row"] and r["shapes"] == ((90, 40), (0,))
        assert r["still_gathered"] == []
    assert rank1["keys"] == 0
    assert rank0["state_row"] and rank0["master_row"]
    assert rank0["logits_equal"] and rank0["tied"]


# --- prefetch along the traced order ------------------------------------------------------------


def _prefetch(max_live: int) -> list[dict]:
    model = build_model()
    engine = hf_zero.initialize(
        model,
        torch.optim.AdamW(two_param_groups(model)),
        stage=3,
        max_live_parameters=max_live,
        **ZERO3,
    )
    per_step = []
    for step in range(3):
        before = dict(engine.coordinator.stats)
        x = batch(dist.get_rank(), step, 0)
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
        per_step.append({k: v - before[k] for k, v in engine.coordinator.stats.items()})
    return per_step


def test_prefetch_follows_the_first_steps_trace():
    for steps in run_distributed(_prefetch, 2, args=(10**9,)):
        # Step 1 records the order: everything is gathered on demand.
        # Order checks: 3 unit entries and the end in forward, 3 units in backward; all waited
        # for at once while there is no agreed trace.
        assert steps[0] == {
            "prefetch_hits": 0, "on_demand_gathers": 5, "held": 0, "checks": 7, "checks_waited": 7
        }  # fmt: skip
        # Later steps: both decoder layers arrive by prefetch in forward and in backward; only
        # the root (first in forward, still gathered at the start of backward) is on demand,
        # and its entry is the only check waited for at once (the others are read lazily).
        for later in steps[1:]:
            assert later == {
                "prefetch_hits": 4, "on_demand_gathers": 1, "held": 0, "checks": 7,
                "checks_waited": 1,
            }, later  # fmt: skip


def _issue_order() -> list[tuple[str, int]]:
    """The gathers started and waited for in the third step's forward, by unit."""
    model = build_model()
    engine = hf_zero.initialize(model, torch.optim.AdamW(model.parameters()), stage=3, **ZERO3)
    events: list[tuple[str, int]] = []
    for unit in engine.coordinator.units:
        for group in unit.groups:
            gather, wait = group.gather, group.wait_gather

            def started(*a, _g=group, _f=gather, _u=unit.index, **k):
                if _g.flat_param is None:
                    events.append(("start", _u))
                return _f(*a, **k)

            def waited(_g=group, _f=wait, _u=unit.index):
                if _g.gather_pending:
                    events.append(("wait", _u))
                return _f()

            group.gather, group.wait_gather = started, waited
    for step in range(3):
        events.clear()
        x = batch(dist.get_rank(), step, 0)
        loss = engine(input_ids=x, labels=x).loss
        forward = list(events)
        engine.backward(loss)
        engine.step()
    return forward


def test_a_unit_waits_for_its_gather_only_after_starting_the_next_ones():
    """The unit needed now starts its gather, then the prefetch behind it, then waits: the
    next unit's bytes are on their way while this rank waits (a link never idles between)."""
    for forward in run_distributed(_issue_order, 2):
        assert forward[:3] == [("start", 0), ("start", 1), ("wait", 0)], forward
        assert forward.index(("start", 2)) < forward.index(("wait", 1)), forward


def test_max_live_parameters_limits_prefetch():
    for steps in run_distributed(_prefetch, 2, args=(1,)):
        assert all(s["prefetch_hits"] == 0 for s in steps)
        # Nothing is on its way when a layer is entered: those checks are waited for at once.
        assert all(s["checks_waited"] >= 5 for s in steps), steps
