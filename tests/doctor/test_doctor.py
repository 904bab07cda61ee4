"""``hf-zero doctor`` and the profiles it reads, checked from outside.

* A profiled run's make-up adds up (objects + runtime + allocator cache + other = the sampled
  peak), the sampled peak is within 5% of the OS's own peak (VmHWM, reset at each step), and
  glibc's own count of the free memory it keeps agrees with what the run was set to do.
* The activations are counted in parts: the head's logits (its output, the loss's
  log-probabilities) and the MLPs' intermediates apart from the rest, each the size the model's
  shape gives.
* Recommendations are predictions that hold: each change is applied in a fresh pair of ranks and
  its measured peak (VmHWM) is within 10% of the predicted one (the long-sequence changes from a
  model whose activations are mostly logits and MLP intermediates). On CPU the first change is to let
  glibc give freed tensors back; the others are predicted from and applied on top of it. (Step
  times are timings, which stay out of pass/fail tests: ``benchmarks/bench_doctor.py`` compares
  predicted and measured step times over interleaved rounds.)
* The doctor wraps an unmodified Trainer launch: it profiles a few steps, ends the run, prints the
  report and the recommendations, writes doctor.json and doctor.png, and the Trainer's own logs
  carry the profile's summary.
* On a slow inter-node link the recommendation is ZeRO++ (from a profile's numbers alone).
"""

import json
import sys

import pytest
from helpers import ACCELERATE, ROOT, launch

from hf_zero.doctor.advice import MMAP_THRESHOLD, Budget, recommend
from hf_zero.doctor.command import parse_size
from hf_zero.doctor.diagnosis import Diagnosis, diagnose, load_profiles
from hf_zero.profiling.process_memory import pooled
from hf_zero.sequence.tiles import LOGITS_TILE_BYTES
from hf_zero.storage.host_memory import unmap_large_frees
from hf_zero.testing import LONG_DOCTOR_MODEL, profiled_training, run_distributed

CASES = {  # stage, micro-batch, accumulation, activation checkpointing, more settings
    "base": (0, 8, 1, False, {}),
    "allocator": (0, 8, 1, False, {}),
    "stage 1": (1, 8, 1, False, {}),
    "stage 2": (2, 8, 1, False, {}),
    "stage 3": (3, 8, 1, False, {}),
    "micro-batch": (0, 4, 2, False, {}),
    "checkpointing": (0, 8, 1, True, {}),
    "offload_optimizer": (2, 8, 1, False, {"offload_optimizer": "cpu"}),
    "offload_param": (3, 8, 1, False, {"offload_param": "cpu"}),
    "lora": (3, 8, 1, False, {"lora": True}),
    "mixz": (3, 8, 1, False, {"lora": True, "quantized_nontrainable_weights": True}),
    "tp": (0, 8, 2, False, {"tp_size": 2}),  # the doctor's flags: tp 2, accumulation 2
    "long": (0, 2, 1, False, {"long": True}),
    "tiled_logits": (0, 2, 1, False, {"long": True, "tiled_logits": True}),
    "tiled_mlp": (0, 2, 1, False, {"long": True, "tiled_mlp": True}),
    "sp": (0, 2, 2, False, {"long": True, "sp_size": 2}),  # sp 2, accumulation 2
}
LONG = {"model_config": LONG_DOCTOR_MODEL, "seq_len": 1024}
"""The long-sequence cases' model and sequence (``"long": True``)."""
AS_LAUNCHED = {"base"}
"""Runs launched as a user would; the others run with the doctor's allocator change applied
(``MALLOC_MMAP_THRESHOLD_``): glibc then gives each freed tensor back to the OS, so RSS follows
the memory in use, as a GPU allocator's count does, instead of also holding a cache whose size
varies from launch to launch (the base run's peak: 955-1,099 MiB over launches without it)."""
PREDICTED_FROM = {
    "allocator": "base",
    "offload_optimizer": "stage 2",
    "offload_param": "stage 3",
    "mixz": "lora",
    "tiled_logits": "long",
    "tiled_mlp": "long",
    "sp": "long",
}
"""The measured run each change is predicted from (the others: "allocator", the base run with
the allocator change); "lora" is a stage-3 run with a frozen base, which is what MixZ++ applies
to."""


def _freed_training(*args, **settings) -> None:
    """`profiled_training` with the allocator change applied. The test's ranks fork from a server
    that is already running, so they set the threshold with ``mallopt`` (``M_MMAP_THRESHOLD``),
    which is what ``MALLOC_MMAP_THRESHOLD_`` sets when a process starts."""
    assert unmap_large_frees(MMAP_THRESHOLD)
    profiled_training(*args, **settings)


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict[str, Diagnosis]:
    root = tmp_path_factory.mktemp("doctor")
    out = {}
    # One recorded step after a warm-up: the optimizer state exists from the first step, so the
    # second already has the run's peak (each measured peak within 4.4% of its prediction here,
    # where the bound is 10%; the 16 runs take 116 s on a 2-core CPU, 167 s with two steps).
    for name, (*case, settings) in CASES.items():  # fresh processes: RSS is not given back
        settings = dict(settings)
        if settings.pop("long", False):
            settings.update(LONG)
        train = profiled_training if name in AS_LAUNCHED else _freed_training
        run_distributed(train, 2, (str(root / name), *case, 1), settings, timeout=300)
        out[name] = diagnose(load_profiles(root / name))
    return out


def test_the_peak_make_up_adds_up_and_matches_the_os(measured):
    base = measured["base"]
    assert sum(base.makeup.values()) == base.peak_bytes
    kinds = {k for k, v in base.makeup.items() if v > 0}
    assert {"params", "grads", "optimizer_states", "runtime"} <= kinds, kinds
    assert base.activations_peak > 100 * 2**20  # ~250 MiB saved for backward at its height
    # glibc's own count: as launched, it keeps the freed activations; with the change, next to
    # nothing at any moment.
    cache = {name: max(m["allocator_cache"] for m in d.moments) for name, d in measured.items()}
    assert cache["base"] > 0.05 * base.peak_bytes, cache
    assert cache["allocator"] < 0.02 * measured["allocator"].peak_bytes, cache
    # The same effective batch in tokens per step: AutoTP's and Ulysses' two ranks share one
    # replica's.
    per_step = {name: d.tokens_per_step for name, d in measured.items()}
    assert per_step["tp"] == per_step["allocator"] == 2 * 8 * 128, per_step
    assert per_step["sp"] == per_step["long"] == 2 * 2 * LONG["seq_len"], per_step
    for name, d in measured.items():
        assert abs(d.peak_bytes / d.os_peak_bytes - 1) < 0.05, (name, d.peak_bytes, d.os_peak_bytes)
        assert set(d.phases_s) >= {"compute", "comm_wait_intra", "optimizer"}
        assert d.tokens_per_s > 0 and d.sent_bytes["intra_node"] > 0


def test_each_recommendation_holds_when_applied(measured):
    """Each kind of change the doctor proposes for these runs, applied: the measured peak is
    within 10% of the predicted one, and a change predicted to save memory saves it."""
    predictions = {name: {c.kind: c for c in recommend(d)} for name, d in measured.items()}
    changes = set(CASES) - {"base", "lora", "long"}
    assert changes <= {k for p in predictions.values() for k in p}
    mib = 2**20
    table = []  # change, before, predicted, measured (MiB)
    for kind in sorted(changes):
        source = PREDICTED_FROM.get(kind, "allocator")
        before = measured[source].os_peak_bytes
        change = predictions[source][kind]
        after = measured[kind].os_peak_bytes
        table.append((kind, before // mib, change.peak_bytes // mib, after // mib))
    print("change, peak before, predicted, measured (MiB):", table)  # shown with pytest -s
    for _kind, before, predicted, after in table:
        assert abs(after / predicted - 1) < 0.10, table
        if predicted < 0.95 * before:
            assert after < before, table


def test_logits_and_mlp_activations_are_counted_apart(measured):
    """At the forward's end the head holds its output and the loss's fp32 log-probabilities
    (two tokens x vocab x 4 bytes) and the hidden states it read; each MLP its input and four
    intermediate-wide values per token (gate, up, the activation, their product)."""
    model = LONG_DOCTOR_MODEL
    tokens = 2 * LONG["seq_len"]  # a rank's micro-batch
    hidden, layers = model["hidden_size"], model["num_hidden_layers"]
    peaks = measured["long"].activation_peaks
    logits = tokens * (2 * model["vocab_size"] + hidden) * 4
    mlp = layers * tokens * (4 * model["intermediate_size"] + hidden) * 4
    assert abs(peaks["logits"] / logits - 1) < 0.02, (peaks, logits)
    assert abs(peaks["mlp_activations"] / mlp - 1) < 0.02, (peaks, mlp)
    assert peaks["activations"] > 0
    # Tiled, the head holds one tile's logits at a time, and each MLP its input.
    tiled = measured["tiled_logits"].activation_peaks["logits"]
    assert tiled <= LOGITS_TILE_BYTES + tokens * hidden * 4 < peaks["logits"] / 3, tiled
    assert measured["tiled_mlp"].activation_peaks["mlp_activations"] <= layers * tokens * hidden * 4
    assert "logits" in measured["long"].makeup and "mlp_activations" in measured["long"].makeup


def _synthetic(inter_wait: float, link_bytes: float) -> Diagnosis:
    """A stage-3 bf16 profile of 2 nodes x 2 ranks whose step waits ``inter_wait`` s on the
    link while each rank sends ``link_bytes`` bytes across it (half gathers, half reductions).
    The real case, profiles of the 2-node cluster benchmark at 0.2, 1 and 10 Gbit/s, is in
    docs/BENCHMARKS.md (a benchmark: it needs network namespaces)."""
    objects = {"params": 2 << 20, "grads": 2 << 20, "optimizer_states": 8 << 20}
    return Diagnosis(
        rank=0, step=1, event="backward", peak_bytes=400 << 20, os_peak_bytes=400 << 20,
        makeup={**objects, "runtime": 380 << 20, "other": 8 << 20}, step_s=inter_wait + 0.2,
        phases_s={"compute": 0.2, "comm_wait_inter": inter_wait},
        tokens_per_s=1000.0, world_size=4, ranks_per_node=2,
        sent_bytes={"intra_node": 1e6, "inter_node": link_bytes,
                    "inter_node.all_gather": link_bytes / 2,
                    "inter_node.reduce_scatter": link_bytes / 2},
        config={"stage": 3, "precision": "bf16", "tp_size": 1},
        model={"parameters": 3_000_000, "trainable": 3_000_000, "units": 4, "hidden_size": 64},
        activations_peak=0,
    )  # fmt: skip


def test_a_slow_inter_node_link_gets_zeropp_first():
    link = 8e6  # bytes each rank sends across nodes per step; the node's 2 ranks share the link
    slow = recommend(_synthetic(2 * link * 8 / 200e6, link), Budget(link_gbps=0.2))
    assert slow[0].kind == "zero++", [(c.kind, c.step_s) for c in slow]
    assert "--zero_quantized_weights true" in " ".join(slow[0].flags)
    assert slow[0].step_s < 0.6 * _synthetic(2 * link * 8 / 200e6, link).step_s
    fast = recommend(_synthetic(2 * link * 8 / 100e9, link), Budget(link_gbps=100))
    zeropp = next(c for c in fast if c.kind == "zero++")
    assert zeropp.step_s > 0.9 * fast[0].step_s  # nothing much to win on a fast link


def test_sizes_and_a_budget_that_nothing_meets():
    assert parse_size("40GiB") == 40 * 2**30 and parse_size("1.5 GB") == 1.5e9
    with pytest.raises(Exception, match="is not a size"):
        parse_size("40 gigs")
    tight = recommend(_synthetic(0.1, 1e6), Budget(device_memory=1 << 20))
    assert tight and not any(c.fits for c in tight)


def test_doctor_profiles_an_unmodified_trainer_launch(tmp_path):
    """``hf-zero doctor -- accelerate launch ... -m hf_zero.run script.py``: two steps after a
    warm-up, then the run ends; the report, the JSON, the picture and the Trainer's logs."""
    out = tmp_path / "doctor"
    script = str(ROOT / "tests" / "scripts" / "stock_trainer.py")
    run = [*ACCELERATE, "-m", "hf_zero.run", script]
    run += ["--output_dir", str(tmp_path / "run"), "--max_steps", "20", "--zero_stage", "3"]
    run += ["--per_device_train_batch_size", "4", "--report_to", "none", "--logging_steps", "50"]
    doctor = [sys.executable, "-m", "hf_zero.cli", "doctor", "--steps", "2", "--out", str(out)]
    done = launch([*doctor, "--device-memory", "4GiB", "--", *run], launcher=())
    assert "Peak memory:" in done.stdout and "| # | change |" in done.stdout, done.stdout
    report = json.loads((out / "doctor.json").read_text())
    assert report["diagnosis"]["config"]["stage"] == 3 and report["changes"]
    assert (out / "doctor.png").stat().st_size > 10_000
    logged = [line for line in done.stdout.splitlines() if "'profile/peak_MiB'" in line]
    assert len(logged) == 1, done.stdout[-3000:]  # the Trainer's log line, once (rank 0)
    assert not (tmp_path / "run" / "report_rank0.json").exists()  # ended after 3 of 20 steps
    profiles = load_profiles(out / "profile")
    assert [len(p["steps"]) for p in profiles] == [2, 2]
    for p in profiles:
        for step in p["steps"]:
            peak = max(s["measured"]["total"] for s in step["timeline"])
            assert abs(peak / step["os_peak"]["total"] - 1) < 0.05
            assert all(pooled(s["objects"], "cpu") for s in step["timeline"])


def test_16bit_storage_is_proposed_where_fp32_state_is_at_the_peak():
    """A bf16 run whose peak holds fp32 masters and Adam state: the doctor proposes keeping
    both in bf16, predicting the master copy gone and the moments halved. (Applied and
    measured: tests/sharding/test_storage_16bit.py and tests/memory/test_memory_rss.py; not here,
    where the profiled runs are fp32, bf16 arithmetic being slow on CPUs without bf16
    instructions.)"""
    d = _synthetic(0.01, 1e6)
    d.makeup = {**d.makeup, "master_weights": 4 << 20}
    change = next(c for c in recommend(d) if c.kind == "storage_16bit")
    assert change.flags == [
        "--zero_master_weights_dtype", "bf16", "--zero_optimizer_states_dtype", "bf16"
    ]  # fmt: skip
    assert sum(d.makeup.values()) - change.peak_bytes == (4 << 20) + (4 << 20), change
    # Parameters offloaded, the optimizer on the device: the master becomes a bf16 copy.
    d.config = {**d.config, "offload_param": "cpu"}
    change = next(c for c in recommend(d) if c.kind == "storage_16bit")
    assert sum(d.makeup.values()) - change.peak_bytes == (2 << 20) + (4 << 20), change
    d.config = {**d.config, "precision": "fp32", "offload_param": "none"}
    assert not any(c.kind == "storage_16bit" for c in recommend(d))
    # Offloaded: the host's fp32 masters and Adam moments, halved.
    d.config = {**d.config, "precision": "bf16", "offload_optimizer": "cpu"}
    d.makeup = {**d.makeup, "master_weights": 0, "optimizer_states": 0}
    d.makeup.update(host_master_weights=4 << 20, host_optimizer_states=8 << 20)
    change = next(c for c in recommend(d) if c.kind == "storage_16bit")
    assert change.flags[-2:] == ["--zero_optimizer_states_dtype", "bf16"]
    assert sum(d.makeup.values()) - change.peak_bytes == (2 << 20) + (4 << 20), change
