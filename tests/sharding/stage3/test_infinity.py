"""ZeRO-Infinity: parameters and optimizer state on CPU memory or NVMe swap files (stage 3).

Offload moves bytes, not arithmetic, so every combination of ``offload_param`` x
``offload_optimizer`` in {none, cpu, nvme} must equal plain stage 3 bit for bit in fp32 (the same
optimizer arithmetic: the user's AdamW, ``offload_optimizer_fast_kernel: false``), and torch DDP
to 1e-6, with accumulation and clipping, at world sizes 2 and 4. The NVMe optimizer step runs the
user's AdamW tile by tile on temporary parameters: elementwise, so the bits do not change.
"""

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import (
    BUCKET,
    ROOT,
    build_model,
    max_loss_diff,
    max_param_diff,
    named_fp32,
    train_ddp,
    train_step,
    train_zero,
    two_param_groups,
)

import hf_zero
from hf_zero.storage.swap import SwapSpace
from hf_zero.testing import run_distributed

STEPS, GAS, CLIP = 3, 2, 0.3
ZERO3 = dict(param_persistence_threshold=50)
DEVICES = ("none", "cpu", "nvme")
BF16_TOL = 1e-2


def _cfg(param: str, optimizer: str, nvme: str, **extra) -> dict:
    cfg = dict(offload_param=param, offload_optimizer=optimizer, **ZERO3, **extra)
    if "nvme" in (param, optimizer):
        cfg["nvme_path"] = nvme
    if optimizer != "none":
        cfg.setdefault("offload_optimizer_fast_kernel", False)  # the user's own AdamW
    return cfg


def _matrix(nvme: str, precision: str, combos: list[tuple[str, str]], tile: int = 0) -> dict:
    if tile:  # the streamed step's tiles: several per group, the pipeline across groups
        import hf_zero.optim.streamed_step

        hf_zero.optim.streamed_step.DEFAULT_TILE = tile
    ref_losses, ref_params = train_ddp(STEPS, GAS, CLIP, precision=precision)
    plain_losses, plain_params, _ = train_zero(STEPS, GAS, CLIP, 3, precision=precision, **ZERO3)
    out = {}
    for param, optimizer in combos:
        cfg = _cfg(param, optimizer, nvme)
        losses, params, engine = train_zero(STEPS, GAS, CLIP, 3, precision=precision, **cfg)
        report = engine.memory_report()
        swap_dirs = [str(s.dir) for s in engine.swaps.values()]
        engine.close()
        out[f"{param}/{optimizer}"] = {
            "equal_to_plain": losses == plain_losses
            and all(torch.equal(params[k], plain_params[k]) for k in params),
            "loss_vs_ddp": max_loss_diff(losses, ref_losses),
            "param_vs_ddp": max_param_diff(params, ref_params),
            "report": report,
            "swap_dirs_left": [d for d in swap_dirs if os.path.exists(d)],
            "params": params,
        }
    return out


ALL = [(p, o) for p in DEVICES for o in DEVICES if (p, o) != ("none", "none")]


def test_small_tiles_stream_across_groups_and_equal_plain_stage3(tmp_path):
    """Tiles of 1024 elements: every group's step is several tiles, and the buffer sets carry
    the reads of one group's first tiles while the previous group's last ones are stepped."""
    combos = [("nvme", "nvme"), ("none", "nvme")]
    for rank_result in run_distributed(_matrix, 2, args=(str(tmp_path), "fp32", combos, 1024)):
        for combo, r in rank_result.items():
            assert r["equal_to_plain"], combo
            assert r["swap_dirs_left"] == [], combo


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_every_tier_combination_equals_plain_stage3_and_ddp(tmp_path, world_size):
    results = run_distributed(_matrix, world_size, args=(str(tmp_path), "fp32", ALL), timeout=600)
    for rank_result in results:
        for combo, r in rank_result.items():
            assert r["equal_to_plain"], combo
            assert r["loss_vs_ddp"] <= 1e-6 and r["param_vs_ddp"] <= 1e-6, (combo, r)
            report = r["report"]
            on_disk = report["nvme_total"] > 0
            assert on_disk == ("nvme" in combo), (combo, report)
            if combo.startswith("nvme/"):
                # fp32 shards in their masters' files when those are on disk too
                shared = combo == "nvme/nvme"
                assert (report["nvme_params"] == 0) == shared, report
                assert report["host_params"] == 0, report
            if combo.endswith("/nvme"):
                # master + two AdamW moments on disk; nothing of them in memory
                assert report["nvme_optimizer_states"] == 2 * report["nvme_master_weights"] > 0
                assert report["host_master_weights"] == report["host_optimizer_states"] == 0
                assert report["master_weights"] == report["optimizer_states"] == 0
            assert r["swap_dirs_left"] == [], combo  # engine.close() removed them
    assert not any(tmp_path.glob("hf_zero-swap-*/rank*")), list(tmp_path.rglob("*"))


def test_bf16_nvme_equals_cpu_offload_and_tracks_ddp(tmp_path):
    combos = [("cpu", "cpu"), ("nvme", "nvme")]
    for r in run_distributed(_matrix, 2, args=(str(tmp_path), "bf16", combos)):
        cpu, nvme = r["cpu/cpu"], r["nvme/nvme"]
        assert all(torch.equal(cpu["params"][k], nvme["params"][k]) for k in cpu["params"])
        assert nvme["loss_vs_ddp"] <= BF16_TOL, nvme["loss_vs_ddp"]


def _fast_kernel(nvme: str) -> dict:
    out = {}
    for optimizer in ("cpu", "nvme"):
        cfg = _cfg("none", optimizer, nvme, offload_optimizer_fast_kernel=True)
        out[optimizer] = train_zero(STEPS, GAS, CLIP, 3, **cfg)[1]
    return out


def test_nvme_step_with_the_fused_kernel_equals_cpu_offload(tmp_path):
    for r in run_distributed(_fast_kernel, 2, args=(str(tmp_path),)):
        assert all(torch.equal(r["cpu"][k], r["nvme"][k]) for k in r["cpu"])


def _read_ahead(nvme: str) -> dict:
    model = build_model(num_hidden_layers=6)
    engine = hf_zero.initialize(
        model,
        torch.optim.AdamW(model.parameters()),
        stage=3,
        reduce_bucket_size=BUCKET,
        offload_param="nvme",
        offload_optimizer="nvme",
        nvme_path=nvme,
        prefetch_bucket_size=1,  # gather one unit ahead: the read-ahead goes further
        **ZERO3,
    )
    train_step(engine, model, 0)
    tiers = [g.tier for g in engine.groups + engine.frozen_groups if g.stage == 3]
    before = sum(t.stats["read_ahead_hits"] for t in tiers)
    train_step(engine, model, 1)
    reads = sum(t.stats["reads"] for t in tiers)
    hits = sum(t.stats["read_ahead_hits"] for t in tiers) - before
    swap = engine.swaps["offload_param"].stats
    engine.close()
    return {"hits": hits, "reads": reads, "units": len(tiers), "swap": swap}


def test_parameter_shards_are_read_ahead_in_the_traced_order(tmp_path):
    for r in run_distributed(_read_ahead, 2, args=(str(tmp_path),)):
        # Step 1 follows the trace: in forward and in backward, every unit after the first two
        # (gathered on demand, gathered by prefetch) was read from disk ahead of its gather.
        assert r["hits"] >= 2 * (r["units"] - 2), r
        assert r["swap"]["read_bytes"] > 0 and r["swap"]["write_bytes"] > 0, r


def _host_budget(nvme: str) -> dict:
    plain_losses, plain_params, _ = train_zero(STEPS, GAS, CLIP, 3, **ZERO3)
    out, total = {}, None
    for share in (0.0, 0.5, 1.0):
        budget = 0 if total is None else int(total * share)
        cfg = _cfg("nvme", "none", nvme, offload_param_max_in_cpu=budget)
        losses, params, engine = train_zero(STEPS, GAS, CLIP, 3, **cfg)
        tiers = [g.tier for g in engine.groups + engine.frozen_groups if g.stage == 3]
        total = sum(t.numel for t in tiers)
        cached = [t for t in tiers if t.cached is not None]
        out[share] = {
            "equal_to_plain": losses == plain_losses
            and all(torch.equal(params[k], plain_params[k]) for k in params),
            "budget": budget,
            "cached_numel": sum(t.numel for t in cached),
            "fetches": sum(t.stats["reads"] for t in tiers),
            "cache_hits": sum(t.stats["cache_hits"] for t in tiers),
            "disk_read_bytes": engine.swaps["offload_param"].stats["read_bytes"],
            "host_params": engine.memory_report()["host_params"],
            "cached_bytes": sum(t.numel * t.itemsize for t in cached),
        }
        engine.close()
    return out


def test_a_host_budget_caches_parameter_shards_and_changes_no_result(tmp_path):
    """``offload_param_max_in_cpu``: the first shards up to the budget stay in host memory,
    gathers take them from there (never read from disk again), updates are written through;
    the results equal plain stage 3 bit for bit at every budget."""
    for r in run_distributed(_host_budget, 2, args=(str(tmp_path),)):
        none, half, whole = r[0.0], r[0.5], r[1.0]
        assert all(x["equal_to_plain"] for x in (none, half, whole)), r
        assert none["cache_hits"] == none["cached_numel"] == 0 < none["disk_read_bytes"], none
        assert 0 < half["cached_numel"] <= half["budget"] < whole["cached_numel"], r
        assert 0 < half["cache_hits"] < half["fetches"], half
        assert 0 < half["disk_read_bytes"] < none["disk_read_bytes"], r
        assert whole["cache_hits"] == whole["fetches"] and whole["disk_read_bytes"] == 0, whole
        for x in (half, whole):
            assert x["host_params"] >= x["cached_bytes"] > 0, x


def _reuse(nvme: str) -> dict:
    from helpers import batch

    plain_losses, plain_params, _ = train_zero(STEPS, GAS, CLIP, 3, **ZERO3)
    out = {}
    unit_numel = None
    for name, distance, live_units in (
        ("off", 0, None),
        ("all", 10**9, None),
        ("bounded", 10**9, 2),
    ):
        # `live_units`: the bound in units (the root and the largest layers).
        live = 10**9 if live_units is None else sum(sorted(unit_numel)[-live_units:])
        cfg = _cfg("nvme", "none", nvme, max_reuse_distance=distance, max_live_parameters=live)
        losses, params, engine = train_zero(STEPS, GAS, CLIP, 3, **cfg)
        units = engine.coordinator.units
        unit_numel = [u.numel for u in units]
        tiers = [g.tier for g in engine.groups + engine.frozen_groups if g.stage == 3]
        reads = sum(t.stats["reads"] for t in tiers)
        gathers = engine.coordinator.stats["on_demand_gathers"]
        gathers += engine.coordinator.stats["prefetch_hits"]
        x = batch(torch.distributed.get_rank(), STEPS, 0)
        loss = engine(input_ids=x, labels=x).loss  # one more step, measured
        held = sum(u.numel for u in units if u.is_gathered)
        engine.backward(loss)
        engine.step()
        out[name] = {
            "equal_to_plain": losses == plain_losses
            and all(torch.equal(params[k], plain_params[k]) for k in params),
            "held_numel": held,
            "live_bound": live,
            "root_numel": units[0].numel,
            "total_numel": sum(unit_numel),
            "reads": sum(t.stats["reads"] for t in tiers) - reads,
            "gathers": engine.coordinator.stats["on_demand_gathers"]
            + engine.coordinator.stats["prefetch_hits"]
            - gathers,
            "shards": len(tiers),
        }
        engine.close()
    return out


def test_units_held_for_reuse_are_not_gathered_or_read_again_in_backward(tmp_path):
    """``max_reuse_distance`` (DeepSpeed's ``stage3_max_reuse_distance``): a unit whose next use
    comes soon enough stays gathered from its forward to its backward, within
    ``max_live_parameters``; backward neither gathers nor reads its shard again; results equal
    plain stage 3 bit for bit."""
    for r in run_distributed(_reuse, 2, args=(str(tmp_path),)):
        off, whole, bounded = r["off"], r["all"], r["bounded"]
        assert all(x["equal_to_plain"] for x in r.values()), r
        # Released after each forward: only the root is gathered when the forward ends.
        assert off["held_numel"] == off["root_numel"], off
        # Everything held: each unit gathered, and each shard read from disk, once per step.
        assert whole["held_numel"] == whole["total_numel"], whole
        assert whole["reads"] == whole["shards"] < off["reads"], r
        assert whole["gathers"] < off["gathers"], r
        # Bounded by max_live_parameters: some held, never more than the bound.
        assert off["root_numel"] < bounded["held_numel"] <= bounded["live_bound"], bounded
        assert whole["reads"] < bounded["reads"] < off["reads"], r


def _segment(cfg: dict, start: int, stop: int, load: str | None, save: str | None) -> dict:
    from test_checkpoint import _rows

    model = build_model()
    engine = hf_zero.initialize(
        model,
        torch.optim.AdamW(two_param_groups(model)),
        stage=3,
        reduce_bucket_size=BUCKET,
        gradient_clipping=1.0,
        **cfg,
    )
    if load:
        engine.load_checkpoint(load)
    losses = []
    for step in range(start, stop):
        x = _rows(step)
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    if save:
        engine.save_checkpoint(save)
    params = named_fp32(model)
    full = engine.full_state_dict(master_weights=True)
    engine.close()
    return {"losses": losses, "params": params, "full": full}


@pytest.mark.slow
def test_checkpoints_round_trip_and_reshard_into_an_infinity_run(tmp_path):
    nvme = _cfg("nvme", "nvme", str(tmp_path / "swap"))
    plain = dict(ZERO3)
    ckpt = str(tmp_path / "ckpt")
    straight = run_distributed(_segment, 2, args=(plain, 0, 4, None, None))[0]
    # Saved by an Infinity run, resumed by another and by plain stage 3: exact.
    run_distributed(_segment, 2, args=(nvme, 0, 2, None, ckpt))
    for cfg in (nvme, plain):
        resumed = run_distributed(_segment, 2, args=(cfg, 2, 4, ckpt, None))[0]
        assert resumed["losses"] == straight["losses"][2:], cfg
        assert all(
            torch.equal(resumed["params"][k], straight["params"][k]) for k in resumed["params"]
        )
    # Saved by plain stage 3 on 4 ranks, loaded into an Infinity run on 2: the same values as a
    # plain stage-3 run on 2 ranks loading it.
    wide = str(tmp_path / "wide")
    run_distributed(_segment, 4, args=(plain, 0, 2, None, wide))
    into_nvme = run_distributed(_segment, 2, args=(nvme, 2, 2, wide, None))[0]
    into_plain = run_distributed(_segment, 2, args=(plain, 2, 2, wide, None))[0]
    for k in into_plain["full"]:
        assert torch.equal(into_nvme["full"][k], into_plain["full"][k]), k
    assert not any((tmp_path / "swap").glob("hf_zero-swap-*/rank*"))


# --- configuration and faults ----------------------------------------------------------------


def test_nvme_needs_stage3_and_a_path():
    with pytest.raises(ValueError, match="'offload_param' = 'nvme' needs 'nvme_path'"):
        hf_zero.ZeroConfig(stage=3, offload_param="nvme").validate()
    with pytest.raises(ValueError, match="'offload_optimizer' = 'nvme' needs 'stage' = 3"):
        hf_zero.ZeroConfig(stage=2, offload_optimizer="nvme", nvme_path="/tmp").validate()
    with pytest.raises(ValueError, match="'offload_param' = 'disk' is not allowed"):
        hf_zero.ZeroConfig(stage=3, offload_param="disk").validate()


def test_deepspeed_nvme_json_is_honoured(tmp_path):
    config = hf_zero.ZeroConfig.load(ROOT / "configs/zero/ds_zero3_nvme.json")
    assert (config.offload_param, config.offload_optimizer) == ("nvme", "nvme")
    assert config.nvme_path_for("offload_param") == "/tmp/hf_zero_nvme"
    assert config.nvme_path_for("offload_optimizer") == "/tmp/hf_zero_nvme"
    assert config.offload_param_buffer_count == 5 and config.offload_optimizer_buffer_count == 4
    assert config.nvme_io_threads == 1  # aio.thread_count, as the Hugging Face docs set it


def test_trainer_flags_select_nvme(tmp_path):
    from hf_zero import ZeroTrainingArguments

    args = ZeroTrainingArguments(
        output_dir=str(tmp_path),
        zero_stage=3,
        offload_param="nvme",
        offload_optimizer="nvme",
        nvme_path=str(tmp_path / "swap"),
        report_to=[],
    )
    assert (args.zero.offload_param, args.zero.offload_optimizer) == ("nvme", "nvme")
    assert args.zero.nvme_path == str(tmp_path / "swap")


def _unwritable(path: str) -> str:
    model = build_model()
    try:
        hf_zero.initialize(
            model, torch.optim.AdamW(model.parameters()), stage=3, offload_param="nvme",
            nvme_path=path,
        )  # fmt: skip
    except ValueError as err:
        return str(err)
    return "no error"


def test_unwritable_nvme_path_is_a_clear_error_before_training(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    message = run_distributed(_unwritable, 2, args=(str(blocker / "swap"),))[0]
    assert "'nvme_path'" in message and str(blocker / "swap") in message, message
    assert "not a writable directory" in message


def test_a_full_disk_is_a_clear_error_naming_the_path(tmp_path, monkeypatch):
    space = SwapSpace(tmp_path, rank=0)

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(ValueError, match="no space left for NVMe offload under nvme_path") as err:
        space.file("master", 1 << 20)
    assert str(tmp_path) in str(err.value) and "MiB free" in str(err.value)
    space.close()
    assert not space.dir.exists()


_CRASH = """
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, {tests!r})
from helpers import build_model
import hf_zero
dist.init_process_group("gloo", init_method="file://" + {store!r}, rank=0, world_size=1)
model = build_model()
engine = hf_zero.initialize(model, torch.optim.AdamW(model.parameters()), stage=3,
                            offload_param="nvme", offload_optimizer="nvme", nvme_path={nvme!r})
print(engine.swaps["offload_param"].dir, flush=True)
raise RuntimeError("boom")
"""


def test_swap_files_are_removed_when_a_run_dies_of_an_exception(tmp_path):
    nvme = tmp_path / "swap"
    script = _CRASH.format(tests=str(ROOT / "tests"), store=str(tmp_path / "store"), nvme=str(nvme))
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert "RuntimeError: boom" in proc.stderr, proc.stderr[-2000:]
    swap_dir = Path(proc.stdout.strip().splitlines()[-1])
    assert swap_dir.parent.parent == nvme
    assert not swap_dir.exists() and not swap_dir.parent.exists()
    assert list(nvme.iterdir()) == []


def test_streamed_safetensors_file_reads_back_with_safetensors(tmp_path):
    from safetensors.torch import load_file

    from hf_zero.storage.safetensors import write_streamed

    a = {"x": torch.randn(5, 3), "step": torch.tensor(7.0)}
    b = {"y": torch.arange(10, dtype=torch.int64), "z": torch.randn(4).to(torch.bfloat16)}
    produced = []

    def piece(tensors):
        spec = {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}
        return spec, lambda: produced.append(sorted(tensors)) or tensors

    write_streamed([piece(a), piece(b)], tmp_path / "f.safetensors")
    loaded = load_file(tmp_path / "f.safetensors")
    assert produced == [["step", "x"], ["y", "z"]]  # one piece at a time, in order
    for k, v in {**a, **b}.items():
        assert torch.equal(loaded[k], v), k


def test_nvme_defaults_keep_the_whole_run_within_the_estimate(tmp_path):
    """Where memory is the point (here both tiers on NVMe), a config that names no sizes gets
    bounded ones: reductions in flight ``2 h^2`` elements rather than two 5e7-element buckets,
    prefetch at most one unit, large frees unmapped. A whole run (partitioned build, 2 steps,
    an evaluation forward, a streamed save) of a 110M model on 2 ranks, measured from outside
    by ``benchmarks/bench_infinity.py``, then grows each rank's peak RSS by no more than
    `hf-zero estimate`'s figure + 10% (with the former defaults: 1.21x)."""
    import json

    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_infinity.py"), "--out", str(tmp_path)]
    cmd += ["--hidden", "768", "--layers", "12", "--steps", "2", "--bw_gib", "0.25"]
    cmd += ["--nvme_path", str(tmp_path / "nvme"), "--reduce_bucket_size", "default"]
    cmd += ["--only", "Infinity nvme/nvme", "--timeout", "600"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = json.loads((tmp_path / "bench_infinity.json").read_text())["runs"]
    ranks = runs["Infinity nvme/nvme"]
    assert len(ranks) == 2
    for r in ranks:
        growth = r["peak"] - r["base_rss"]
        assert growth <= 1.10 * r["estimate"], (growth / r["estimate"], r["estimate"])
        assert growth >= 0.6 * r["estimate"], (growth / r["estimate"], r["estimate"])


def test_memory_first_defaults_are_bounded_and_given_sizes_kept():
    h = 768
    nvme = dict(stage=3, offload_param="nvme", offload_optimizer="nvme", nvme_path="/tmp")
    bounded = hf_zero.ZeroConfig(**nvme).resolved(hidden_size=h)
    assert bounded.reduce_inflight_numel == 2 * h * h  # not 2 x the 5e7 bucket
    assert bounded.prefetch_bucket_size <= h * h
    offloaded = hf_zero.ZeroConfig(stage=3, offload_param="cpu").resolved(hidden_size=None)
    assert offloaded.prefetch_bucket_size == 1  # one unit ahead, with no hidden size to size it
    plain = hf_zero.ZeroConfig(stage=3).resolved(hidden_size=h)
    assert plain.reduce_inflight_numel == 2 * plain.reduce_bucket_size == 10**8
    given = hf_zero.ZeroConfig(**nvme, reduce_inflight_numel=10**8, prefetch_bucket_size=10**7)
    given.resolved(hidden_size=h)
    assert (given.reduce_inflight_numel, given.prefetch_bucket_size) == (10**8, 10**7)


def test_memory_first_unmaps_unless_reuse_is_asked_for():
    from hf_zero.storage.host_memory import HostMemoryPolicy

    bounded = HostMemoryPolicy(on_cpu=True, setting="release", memory_first=True, stage=3)
    assert bounded.unmap and not bounded.reuse  # the default where memory is the point
    asked = HostMemoryPolicy(on_cpu=True, setting="reuse", memory_first=True, stage=3)
    assert asked.reuse and not asked.unmap and not asked.trim_after_step
    on_gpu = HostMemoryPolicy(on_cpu=False, setting="reuse", memory_first=True, stage=3)
    assert not (on_gpu.reuse or on_gpu.unmap or on_gpu.trim_after_step)
