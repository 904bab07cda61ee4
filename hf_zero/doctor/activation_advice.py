"""The changes that shrink what autograd keeps for backward, with their predicted peak and step.

A profile counts the activations in three parts (`hf_zero.profiling.activations`): the head's
``logits`` (its output, the loss's log-probabilities, the hidden states it reads), the MLPs'
``mlp_activations`` and the rest (``activations``). Each change acts on the parts it removes:

* activation checkpointing: every layer's activations but its input (the head is not a layer);
* a halved micro-batch, sequence parallelism (``sp_size``): every part, by the tokens a rank holds;
* tiled logits: the head's whole-sequence logits for one tile's;
* tiled MLP: the MLPs' intermediates for their input.

The head's backward makes temporaries as large as the logits again (their gradients), which a
profile counts as "other" at the moments the logits are held (`head_temporaries`): the changes to
the head shrink them too.
"""

from __future__ import annotations

from collections.abc import Callable

from hf_zero.doctor.basis import ASSUMED, dtype_bytes, mib, tokens_per_rank
from hf_zero.doctor.diagnosis import Diagnosis
from hf_zero.sequence.tiles import LOGITS_TILE_BYTES
from hf_zero.sequence.ulysses import check_heads

PARTS = ("activations", "mlp_activations", "logits")
"""The activation parts of a profile's make-up."""


def held(now: dict[str, int]) -> int:
    """Activation bytes held at this moment (every part)."""
    return sum(now.get(part, 0) for part in PARTS)


def head_temporaries(now: dict[str, int]) -> int:
    """Of "other" at this moment, the head's backward temporaries: the gradients of its logits
    and log-probabilities, made one after the other while the log-probabilities are held (up to
    half the logits part: the forward's output and the log-probabilities)."""
    return int(min(max(now.get("other", 0), 0), 0.5 * now.get("logits", 0)))


def less_activations(now: dict[str, int], share: float | dict[str, float], peak: int) -> dict:
    """The objects with activations ``share`` smaller (one share for every part, or one per
    part; the head's temporaries go with the logits), and the freed ones the allocator still
    keeps (``allocator_cache``, up to the step's activation ``peak`` less those held: a moment
    after backward sits on the activations' high-water mark) shrunk alike."""
    shares = share if isinstance(share, dict) else dict.fromkeys(PARTS, share)
    out = dict(now)
    for part, s in shares.items():
        out[part] = int(now.get(part, 0) * (1 - s))
    if "logits" in shares and "other" in now:
        out["other"] = int(now["other"] - head_temporaries(now) * shares["logits"])
    before = held(now)
    overall = 1 - held(out) / before if before else sum(shares.values()) / len(shares)
    cache = now.get("allocator_cache", 0)
    freed = min(max(cache, 0), max(0, peak - before))
    if "allocator_cache" in now:
        out["allocator_cache"] = int(cache - freed * overall)
    return out


Add = Callable[..., None]


def _removed(now: dict, objects: dict, what: str) -> str:
    """What a change removes at this moment (the peak's, in the report)."""
    nbytes = held(now) + now.get("other", 0) - held(objects) - objects.get("other", 0)
    return f"{mib(nbytes)} of {what}"


def activation_changes(d: Diagnosis, now: dict, units: int, budget, add: Add) -> None:
    """Every change to the activations that applies to this run, priced at moment ``now``."""
    if not d.activations_peak:
        return
    _checkpointing(d, now, units, add)
    _micro_batch(d, now, add)
    _tiled_logits(d, now, add)
    _tiled_mlp(d, now, add)
    _sequence_parallel(d, now, budget, add)


def _micro_tokens(d: Diagnosis) -> float:
    """Tokens one forward on one rank sees (one micro-batch, its slice under sequence
    parallelism)."""
    return tokens_per_rank(d) / max(1, d.micro_batches)


def _checkpointing(d: Diagnosis, now: dict, units: int, add: Add) -> None:
    hidden = d.model.get("hidden_size") or 0
    layers = d.activations_peak - d.activation_peaks.get("logits", 0)  # the head is not a layer
    inputs = units * _micro_tokens(d) * hidden * dtype_bytes(d)
    # Each unit's input stays; in backward one unit's activations are recomputed, and their
    # gradients and the gradient of the unit's input are made (about three units' worth). While
    # the head's logits are held, backward has not reached a layer: only the inputs are.
    recomputed = 3 * layers / units
    if not hidden or inputs + recomputed >= layers:
        return
    kept = inputs + (0 if now.get("logits", 0) else recomputed)
    share = 1 - kept / layers
    parts = {"activations": share, "mlp_activations": share}
    objects = less_activations(now, parts, d.activations_peak)
    compute = d.phases_s.get("compute", 0.0)
    add("checkpointing", "recompute activations in backward (activation checkpointing)",
        ["--gradient_checkpointing", "true"], objects,
        d.step_s + ASSUMED["recompute_share"] * compute, _removed(now, objects, "activations"))  # fmt: skip


def _micro_batch(d: Diagnosis, now: dict, add: Add) -> None:
    micro, gas, a = d.micro_batch or 0, d.micro_batches, d.activations_peak
    if micro < 2:
        return
    extra = d.phases_s.get("comm_wait_intra", 0) + d.phases_s.get("comm_wait_inter", 0)
    extra = extra if d.config.get("stage") == 3 else 0.0  # stage 3 gathers per micro-batch
    objects = less_activations(now, 0.5, a)
    add("micro-batch", "halve the micro-batch, double accumulation (same effective batch)",
        ["--per_device_train_batch_size", str(micro // 2),
         "--gradient_accumulation_steps", str(gas * 2)],
        objects, d.step_s + extra, _removed(now, objects, "activations"))  # fmt: skip


def _tiled_logits(d: Diagnosis, now: dict, add: Add) -> None:
    """The head and its loss over tiles of `LOGITS_TILE_BYTES` of fp32 logits: what stays is
    the hidden states the head reads (recomputed from in backward) and, while a tile is in
    backward, `ASSUMED` ``logits_tile_transients`` tiles."""
    vocab, hidden = d.model.get("vocab_size") or 0, d.model.get("hidden_size") or 0
    logits = d.activation_peaks.get("logits", 0)
    if d.config.get("tiled_logits") is True or not (vocab and hidden and logits):
        return
    tokens = _micro_tokens(d)
    tile_tokens = max(1, LOGITS_TILE_BYTES // (4 * vocab))
    tile = ASSUMED["logits_tile_transients"] * min(tokens, tile_tokens) * vocab * 4
    kept = tokens * hidden * dtype_bytes(d)
    if tokens <= tile_tokens or logits <= kept + tile:
        return  # one tile is the whole batch's logits
    objects = dict(now)
    if now.get("logits", 0):
        objects["logits"] = int(min(now["logits"], kept))
        objects["other"] = int(now.get("other", 0) - head_temporaries(now) + tile)
    share = hidden * vocab / max(1, 3 * (d.model.get("parameters") or 1))  # head's forward again
    add("tiled_logits", "compute the head and its loss a tile of the sequence at a time "
        "(tiled logits)", ["--zero_tiled_logits", "true"], objects,
        d.step_s + share * d.phases_s.get("compute", 0.0),
        _removed(now, objects, "logits and their gradients"))  # fmt: skip


def _tiled_mlp(d: Diagnosis, now: dict, add: Add) -> None:
    """Each MLP over tiles of ``hidden_size`` tokens: what stays is its input."""
    mlp = d.activation_peaks.get("mlp_activations", 0)
    hidden, layers = d.model.get("hidden_size") or 0, d.model.get("num_hidden_layers") or 0
    if d.config.get("tiled_mlp") or not (mlp and hidden and layers):
        return
    tokens = _micro_tokens(d)
    kept = layers * tokens * hidden * dtype_bytes(d)
    if tokens / max(1, d.micro_batch or 1) <= hidden or mlp <= 2 * kept:
        return  # a sequence no longer than one tile runs untiled
    intermediate = d.model.get("intermediate_size") or 0
    share = hidden * intermediate * layers / max(1, d.model.get("parameters") or 1)
    objects = less_activations(now, {"mlp_activations": 1 - kept / mlp}, d.activations_peak)
    add("tiled_mlp", "run each MLP a tile of the sequence at a time (tiled MLP)",
        ["--zero_tiled_mlp", "true"], objects, d.step_s + share * d.phases_s.get("compute", 0.0),
        _removed(now, objects, "MLP intermediates"))  # fmt: skip


def sp_degree(d: Diagnosis, budget) -> int | None:
    """The sequence-parallel degree to propose: the smallest power of two the world, the
    node and the heads allow whose predicted peak fits the budget, else the largest; None when
    none applies."""
    if (d.config.get("sp_size") or 1) > 1 or (d.config.get("tp_size") or 1) > 1:
        return None
    heads = d.model.get("num_attention_heads") or 0
    kv = d.model.get("num_key_value_heads") or heads
    per_node = (budget.gpus_per_node if budget else None) or d.ranks_per_node
    allowed = []
    k = 2
    while heads and k <= min(d.world_size, per_node):
        try:
            check_heads(heads, kv, k)
            if d.world_size % k == 0:
                allowed.append(k)
        except ValueError:
            pass
        k *= 2
    if not allowed:
        return None
    limit = budget.device_memory if budget else None
    for k in allowed:
        peak = sum(less_activations(d.makeup, 1 - 1 / k, d.activations_peak).values())
        if limit is None or peak <= limit:
            return k
    return allowed[-1]


def _sequence_parallel(d: Diagnosis, now: dict, budget, add: Add) -> None:
    """Ulysses over ``k`` ranks: each holds 1/k of every sequence's activations; the ``k``
    ranks share one batch, so k times the accumulation keeps the effective batch. Each layer
    exchanges q, k, v and the attention output in forward and their gradients in backward."""
    k = sp_degree(d, budget)
    if k is None:
        return
    hidden, layers = d.model.get("hidden_size") or 0, d.model.get("num_hidden_layers") or 0
    heads = d.model.get("num_attention_heads") or 1
    kv = max(d.model.get("num_key_value_heads") or heads, k)  # fewer than k are repeated
    per_layer = 2 * (2 * hidden + 2 * hidden * kv / heads) * _micro_tokens(d) / k
    payload = per_layer * dtype_bytes(d) * (k - 1) / k * layers * d.micro_batches * k
    rate = ASSUMED["sp_all_to_all_gbytes_per_s"]["cpu" if d.device == "cpu" else "other"]
    gas = d.micro_batches * k
    objects = less_activations(now, 1 - 1 / k, d.activations_peak)
    add("sp", f"split every sequence over {k} ranks (Ulysses sequence parallelism)",
        ["--zero_sp_size", str(k), "--gradient_accumulation_steps", str(gas)], objects,
        d.step_s + payload / (rate * 1e9), _removed(now, objects, "activations"),
        [f"{mib(payload)} exchanged by all-to-alls per step; accumulation x{k} keeps "
         "the effective batch"])  # fmt: skip
