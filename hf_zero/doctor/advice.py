"""From a measured profile to the changes that would fix what is over budget, each with its
predicted peak memory and step time, in the order of docs/USER_GUIDE.md's table ("what is over
budget -> method -> what to verify").

Predictions start from the measurement, not from formulas alone: the objects at the measured
peak are rescaled by what the change does to them (ZeRO's 1/N for what a stage shards, the
bytes a quantized format keeps, what activation checkpointing saves), the runtime and "other"
bytes are kept as measured, and the step's measured phases are rescaled (collective waits in
proportion to the bytes on the link, or bytes / ``--link-gbps`` when given). Assumptions are
named where they are made (`ASSUMED`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_zero.doctor.activation_advice import activation_changes, less_activations
from hf_zero.doctor.basis import ASSUMED, dtype_bytes, mib, scaled, tokens_per_rank
from hf_zero.doctor.diagnosis import Diagnosis

MMAP_THRESHOLD = 128 * 1024
"""Bytes above which glibc's malloc maps each allocation on its own and unmaps it on free when
the threshold is fixed (by setting it): freed tensors then leave the resident set."""

ONE_POOL = (
    "on a CPU-only machine host and device are the same memory: the peak stays (in fp32 it "
    "grows by the host's master copy of the shard)"
)
QUANT_BLOCK = 256
"""Elements per scale of hf_zero's INT8 and INT4 blocks (one fp32 scale each)."""


@dataclass
class Budget:
    """What the user has: memory per rank, the inter-node link, the cluster's shape."""

    device_memory: float | None = None
    """Bytes per rank (on CPU: the process's resident memory)."""
    host_memory: float | None = None
    link_gbps: float | None = None
    gpus_per_node: int | None = None
    nodes: int | None = None


@dataclass
class Change:
    """One recommended change, with what it is predicted to do."""

    kind: str
    what: str
    flags: list[str]
    peak_bytes: int
    step_s: float
    removes: str
    fits: bool = True
    notes: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables to set for the launch (every rank), besides ``flags``."""


def recommend(d: Diagnosis, budget: Budget | None = None) -> list[Change]:
    """The changes that apply to this run, fitting ones first, each group fastest first.

    Each change's predicted peak is the highest of its predictions at every sampled moment of
    the step: a change can move the peak (activation checkpointing leaves the optimizer step's
    temporaries on top)."""
    budget = budget or Budget()
    changes = _changes_at(d, d.makeup, budget)
    highest: dict[str, int] = {}
    for moment in d.moments:
        for c in _changes_at(d, moment, budget):
            highest[c.kind] = max(highest.get(c.kind, 0), c.peak_bytes)
    for c in changes:
        c.peak_bytes = max(c.peak_bytes, highest.get(c.kind, 0))
        c.fits = budget.device_memory is None or c.peak_bytes <= budget.device_memory
    # Giving freed memory back costs step time: worth it only where the cache is at the peak.
    changes = [c for c in changes if c.kind != "allocator" or c.peak_bytes < 0.95 * d.peak_bytes]
    changes.sort(key=lambda c: (not c.fits, c.step_s))
    return changes


def _changes_at(d: Diagnosis, now: dict[str, int], budget: Budget) -> list[Change]:
    """The changes, with the peak each would have at the moment whose make-up is ``now``."""
    n = max(1, d.world_size // max(1, d.config.get("tp_size") or 1))
    stage = d.config.get("stage") or 0
    units = max(1, d.model.get("units") or 1)
    now = dict(now)
    changes: list[Change] = []
    comm = d.phases_s.get("comm_wait_intra", 0.0) + d.phases_s.get("comm_wait_inter", 0.0)

    def add(kind, what, flags, objects, step_s, removes, notes=(), env=None):
        peak = sum(objects.values())
        fits = budget.device_memory is None or peak <= budget.device_memory
        changes.append(
            Change(kind, what, flags, peak, step_s, removes, fits, list(notes), dict(env or {}))
        )

    m, o = now.get("master_weights", 0), now.get("optimizer_states", 0)
    g, p = now.get("grads", 0), now.get("params", 0)
    if stage < 1 and m + o:
        objects = scaled(now, master_weights=1 / n, optimizer_states=1 / n)
        removes = f"{mib((m + o) * (1 - 1 / n))} of master weights and optimizer state"
        add("stage 1", "shard the optimizer state (ZeRO-1)", ["--zero_stage", "1"], objects,
            d.step_s, removes)  # fmt: skip
    if stage < 2 and m + o + g:
        objects = scaled(now, master_weights=1 / n, optimizer_states=1 / n, grads=1 / n)
        removes = f"{mib((m + o + g) * (1 - 1 / n))} of gradients and optimizer state"
        add("stage 2", "shard gradients too (ZeRO-2)", ["--zero_stage", "2"], objects,
            d.step_s, removes)  # fmt: skip
    if stage < 3 and p:
        working = 2 * p / units  # two units gathered at once (the current one, the prefetched)
        objects = scaled(now, master_weights=1 / n, optimizer_states=1 / n, grads=1 / n)
        objects["params"] = int(p / n + working)
        compute = d.phases_s.get("compute", 0.0)
        step = d.step_s + 0.5 * comm + ASSUMED["stage3_compute_share"] * compute
        note = "~1.5x the communication of stage 2, plus gathering and releasing each unit"
        add("stage 3", "shard the parameters too (ZeRO-3)", ["--zero_stage", "3"], objects,
            step, f"{mib(p - objects['params'])} of parameters", [note])  # fmt: skip
    _offload(d, now, stage, add)
    _storage_16bit(d, now, add)
    _frozen_base(d, now, stage, n, add)
    activation_changes(d, now, units, budget, add)
    _tensor_parallel(d, now, budget, add)
    _zeropp(d, now, stage, budget, add)
    _allocator(d, now, add)
    return changes


def _allocator(d: Diagnosis, now: dict, add) -> None:
    """On CPU, glibc keeps freed memory for reuse (the activations of the last backward, most
    of all); with a fixed mmap threshold each large tensor is given back to the OS when freed."""
    cache = max((m.get("allocator_cache", 0) for m in [d.makeup, *d.moments]), default=0)
    if d.device != "cpu" or cache < 0.05 * d.peak_bytes:
        return
    compute = d.phases_s.get("compute", 0.0)
    add("allocator", "give freed tensors back to the OS (glibc's malloc: fixed mmap threshold)",
        [], dict(now, allocator_cache=0), d.step_s + ASSUMED["fresh_pages_share"] * compute,
        f"{mib(d.makeup.get('allocator_cache', 0))} of freed memory malloc keeps at the peak",
        ["set for every rank's environment (e.g. before `accelerate launch`)"],
        env={"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)})  # fmt: skip


def _offload(d: Diagnosis, now: dict, stage: int, add) -> None:
    one_pool = d.device == "cpu"
    m, o = now.get("master_weights", 0), now.get("optimizer_states", 0)
    moved = m + o
    if stage >= 1 and moved and d.config.get("offload_optimizer") in (None, "none"):
        n = max(1, d.world_size // max(1, d.config.get("tp_size") or 1))
        # The host keeps an fp32 master of the rank's shard even in fp32 training, where the
        # device's own parameters were the master before.
        master = m or int(d.model.get("trainable", 0) * 4 / n)
        objects = dict(now, master_weights=0, optimizer_states=0)
        objects.update(host_master_weights=master, host_optimizer_states=o)
        if not one_pool:
            objects = {k: v for k, v in objects.items() if not k.startswith("host_")}
        copy = 2 * moved / 3 / (ASSUMED["copy_gbytes_per_s"] * 1e9)
        add("offload_optimizer", "fp32 master weights and Adam state to CPU memory (ZeRO-Offload)",
            ["--zero_offload_optimizer", "cpu"], objects, d.step_s + copy,
            f"{moved / 2**20:.1f} MiB from the device to host memory",
            [ONE_POOL])  # fmt: skip
    if stage == 3 and d.config.get("offload_param") in (None, "none"):
        _offload_param(d, now, add)


STORAGE_16BIT_PLACES = {
    # offload_optimizer -> (prefix of the memory kinds, the master's bytes kept per fp32 byte,
    # the evidence shown with the change)
    "none": ("", 0, "loss within 1.5% of fp32 masters over 200 steps"),
    "cpu": ("host_", 0.5, "bit-identical to bf16 storage on the device"),
}
"""Where a bf16 run's masters and Adam state live, and what keeping them in bf16 leaves there:
on the device the bf16 parameters become the master (no copy; a bf16 copy where the parameters
are offloaded); on the host a bf16 master."""


def _storage_16bit(d: Diagnosis, now: dict, add) -> None:
    """bf16 runs whose peak holds fp32 master weights or optimizer state, on the device or
    offloaded to the host: keep both in bf16 (Adam's moments halve; the master as
    `STORAGE_16BIT_PLACES` says). Each bucket's step widens its part to fp32 and back: one
    bucket's fp32 copy at a time, not counted."""
    c = d.config
    place = STORAGE_16BIT_PLACES.get(c.get("offload_optimizer") or "none")
    if c.get("precision") != "bf16" or place is None or (c.get("pp_size") or 1) > 1:
        return
    prefix, master_kept, evidence = place
    if not prefix and c.get("offload_param") not in (None, "none"):
        master_kept = 0.5  # the parameters are elsewhere: the master is a bf16 copy of them
    master, states = f"{prefix}master_weights", f"{prefix}optimizer_states"
    m, o = now.get(master, 0), now.get(states, 0)
    on = c.get("master_weights_dtype") == "bf16", c.get("optimizer_states_dtype") == "bf16"
    if not m + o or all(on):
        return
    objects = dict(now)
    objects[master] = m if on[0] else int(m * master_kept)
    objects[states] = o if on[1] else o // 2
    # Widening and narrowing read and write the state once more per step: memory-bound.
    extra = 3 * (m + o) / (ASSUMED["copy_gbytes_per_s"] * 1e9)
    flags = ["--zero_master_weights_dtype", "bf16", "--zero_optimizer_states_dtype", "bf16"]
    where = " in host memory" if prefix else ""
    add("storage_16bit", f"bf16 master weights and optimizer state{where} (fp32 arithmetic per "
        "bucket)", flags, objects, d.step_s + extra,
        f"{mib(sum(now.values()) - sum(objects.values()))} of fp32 masters and Adam state{where}",
        [f"{evidence} (tests/sharding/test_storage_16bit.py)"])  # fmt: skip


def _offload_param(d: Diagnosis, now: dict, add) -> None:
    """Stage 3's parameter shards to host memory; gathers copy them back, twice a step."""
    n = max(1, d.world_size)  # under AutoTP each rank shards its 1/tp slice over the replicas
    shard = min(now.get("params", 0), int((d.model.get("parameters") or 0) * dtype_bytes(d) / n))
    if not shard:
        return
    objects = dict(now, params=now.get("params", 0) - shard)
    objects["host_params"] = objects.get("host_params", 0) + shard
    notes = [ONE_POOL] if d.device == "cpu" else []
    if d.config.get("precision") in (None, "fp32") and not now.get("master_weights"):
        # fp32 masters alias a device shard; once the shard is on the host they are their own
        # copy, on the optimizer's side (the device unless the optimizer is offloaded too).
        master = int((d.model.get("trainable") or 0) * 4 / n)
        offloaded = d.config.get("offload_optimizer") not in (None, "none")
        side = "host_master_weights" if offloaded else "master_weights"
        objects[side] = objects.get(side, 0) + master
        notes.append("fp32: the device keeps an fp32 master of the shard unless "
                     "`offload_optimizer` moves it too")  # fmt: skip
    if d.device != "cpu":
        objects = {k: v for k, v in objects.items() if not k.startswith("host_")}
    copy = 2 * shard / (ASSUMED["copy_gbytes_per_s"] * 1e9)  # forward's gathers and backward's
    add("offload_param", "parameter shards to CPU memory (ZeRO-Infinity's CPU tier)",
        ["--zero_offload_param", "cpu"], objects, d.step_s + copy,
        f"{mib(shard)} of parameter shards from the device to host memory", notes)  # fmt: skip


def _frozen_base(d: Diagnosis, now: dict, stage: int, n: int, add) -> None:
    total, trainable = d.model.get("parameters") or 0, d.model.get("trainable") or 0
    if not total or trainable >= total or d.config.get("quantized_nontrainable_weights"):
        return
    p, size = now.get("params", 0), dtype_bytes(d)
    units = max(1, d.model.get("units") or 1)
    # The frozen base becomes INT8 shards; the units gathered for compute stay dequantized
    # (at stage 3 what "params" holds beyond the shards; else two units, as stage 3 gathers).
    working = max(0.0, p - total * size / n) if stage == 3 else 2 * p / units
    kept = (total - trainable) * (1 + 4 / QUANT_BLOCK) / n
    objects = dict(now, params=int(trainable * size / n + working + kept))
    # Every gather (forward's and backward's) dequantizes the whole frozen part of its unit.
    dequantize = 2 * (total - trainable) * size / (ASSUMED["dequantize_gbytes_per_s"] * 1e9)
    add("mixz", "keep the frozen base as INT8 shards (MixZ++)",
        ["--zero_stage", "3", "--zero_quantized_nontrainable_weights", "true"], objects,
        d.step_s + dequantize,
        f"{max(0.0, p - objects['params']) / 2**20:.1f} MiB of frozen weights")  # fmt: skip


def _tensor_parallel(d: Diagnosis, now: dict, budget: Budget, add) -> None:
    per_node = budget.gpus_per_node or d.ranks_per_node
    if per_node < 2 or (d.config.get("tp_size") or 1) > 1:
        return
    k = 2
    split = ("params", "grads", "master_weights", "optimizer_states")
    objects = scaled(now, **dict.fromkeys(split, 1 / k))
    layers = d.model.get("num_hidden_layers") or d.model.get("units") or 1
    tokens = tokens_per_rank(d) / max(1, d.micro_batches)
    hidden_wide = layers * tokens * (d.model.get("hidden_size") or 0) * dtype_bytes(d)
    a = d.activations_peak
    if a:
        # The residual stream stays whole on every rank: each decoder layer's two norms keep
        # their input and their output (4 hidden-wide values per token), plus the final norm's;
        # attention heads and the MLP's intermediate activations are split k ways.
        whole = hidden_wide * (4 + 2 / layers)
        objects = less_activations(objects, (1 - min(1.0, whole / a)) * (1 - 1 / k), a)
    else:
        objects = scaled(objects, activations=1 / k)
    # k ranks now share each micro-batch: k times the accumulation keeps the effective batch,
    # and each rank computes 1/k of every matrix product for k times the micro-batches. Each
    # layer all-reduces two hidden-wide outputs in forward and two input gradients in backward.
    payload = 4 * hidden_wide * k * max(1, d.micro_batches)
    rate = ASSUMED["tp_allreduce_gbytes_per_s"]["cpu" if d.device == "cpu" else "other"]
    add("tp", f"split each layer's matrices over {k} ranks (AutoTP)",
        ["--zero_tp_size", str(k), "--gradient_accumulation_steps", str(k * d.micro_batches)],
        objects, d.step_s + payload / (rate * 1e9),
        f"{(sum(now.values()) - sum(objects.values())) / 2**20:.1f} MiB of one rank's share",
        [f"{mib(payload)} of activations all-reduced inside the node per step"])  # fmt: skip


def _zeropp(d: Diagnosis, now: dict, stage: int, budget: Budget, add) -> None:
    nodes = budget.nodes or d.nodes
    sent = d.sent_bytes
    inter = sent.get("inter_node", 0)
    on = d.config.get("quantized_weights") or d.config.get("quantized_gradients")
    if nodes < 2 or not inter or stage != 3 or on:
        return
    b = dtype_bytes(d)
    gather, reduce = sent.get("inter_node.all_gather", 0), sent.get("inter_node.reduce_scatter", 0)
    rest = inter - gather - reduce
    # qwZ: INT8 + a scale per block; hpZ: the backward gather stays in the node (half of them).
    gather_new = gather / 2 * (1 + 4 / QUANT_BLOCK) / b
    reduce_new = reduce * (0.5 + 4 / QUANT_BLOCK) / 4  # qgZ: INT4 over the link (fp32 reduced)
    new = gather_new + reduce_new + max(0, rest)
    # With the link's rate known, the measured wait is the link's time for a node's bytes (the
    # node's ranks share it) plus what does not shrink with bytes (latency, host work); without
    # it, the whole wait is taken to shrink with the bytes.
    wait = d.phases_s.get("comm_wait_inter", 0.0)
    wait_new, wait_now = wait * new / inter, wait
    if budget.link_gbps:
        per_node = budget.gpus_per_node or d.ranks_per_node
        link = per_node * 8 / (budget.link_gbps * 1e9)  # seconds per byte a rank sends
        fixed = max(0.0, wait - inter * link)
        wait_new = new * link + fixed
    quantized = (gather + reduce) / max(1, nodes)
    quantize = quantized / (ASSUMED["quantize_gbytes_per_s"] * 1e9)
    hpz = budget.gpus_per_node or d.ranks_per_node
    params = now.get("params", 0)
    objects = dict(now, secondary_params=int(params * (1 + 4 / QUANT_BLOCK) / b / hpz))
    what = "quantized weight gather, intra-node secondary partition, quantized gradients (ZeRO++)"
    wait_note = f"inter-node wait {wait_now * 1000:.0f} -> {wait_new * 1000:.0f} ms per step"
    add("zero++", what,
        ["--zero_quantized_weights", "true", "--zero_hpz_partition_size", str(hpz),
         "--zero_quantized_gradients", "true"], objects,
        d.step_s - wait + wait_new + quantize,
        f"{(inter - new) / 2**20:.1f} of {inter / 2**20:.1f} MiB per step off the inter-node link",
        [wait_note])  # fmt: skip


def format_changes(d: Diagnosis, changes: list[Change], budget: Budget | None = None) -> str:
    """The recommendations as a table (fitting ones first), with the flags to apply."""
    budget = budget or Budget()
    where = f" (budget {budget.device_memory / 2**30:.2f} GiB)" if budget.device_memory else ""
    lines = [
        f"Now: peak {d.peak_bytes / 2**20:,.1f} MiB{where}, step {d.step_s * 1000:.1f} ms",
        "",
        "| # | change | predicted peak | fits | predicted step | removes | flags |",
        "|---|---|---:|---|---:|---|---|",
    ]
    for i, c in enumerate(changes, 1):
        lines.append(
            f"| {i} | {c.what} | {c.peak_bytes / 2**20:,.1f} MiB | {'yes' if c.fits else 'no'} "
            f"| {c.step_s * 1000:.1f} ms ({c.step_s / d.step_s:.2f}x) | {c.removes} "
            f"| `{' '.join([*(f'{k}={v}' for k, v in c.env.items()), *c.flags])}` |"
        )
    if not changes:
        lines.append("| - | nothing to change: no mechanism applies to this run | | | | | |")
    return "\n".join(lines)
