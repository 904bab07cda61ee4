"""Per-rank model-state memory of each ZeRO stage: the formulas `memory_report()` is held to.

For ``P`` trainable parameters on ``N`` data-parallel ranks with Adam (8 bytes of state per
parameter), hf_zero holds, per rank, at the model-state peak (see "resident" below):

=====  ==============  ========================  ===================  ============  =============
stage  parameters      gradients                 fp32 master weights  Adam state    bf16 total
=====  ==============  ========================  ===================  ============  =============
0      b P             b P                       4 P (0 in fp32)      8 P           16P
1      b P             b P                       4 P/N (0 in fp32)    8 P/N         4P + 12P/N
2      b P             b P/N  (4 P/N: see below)  4 P/N (0 in fp32)    8 P/N         2P + 14P/N
3      b P/N           b P/N  (4 P/N: see below)  4 P/N (0 in fp32)    8 P/N         16P/N
=====  ==============  ========================  ===================  ============  =============

``b`` is the compute dtype's size (2 for bf16/fp16, 4 for fp32). For 16-bit training these are
the ZeRO paper's formulas: gradients are held in 16 bits (stage 0: the gradient buffer all-reduced
in place; stage 1: the reduced shard copied into the buffer's own region; stages 2-3: the reduced
16-bit shard) and converted to fp32 one bucket at a time inside the optimizer step
(`hf_zero.sharding.grad_store`). Kept on purpose, above the paper: with ``gradient_accumulation_steps``
> 1, stages 2-3 sum the micro-batches of a window in an fp32 gradient shard (4 P/N instead of
b P/N: exact accumulation) from the second micro-batch until the step.

**Resident** means held by the rank's tensors (what `memory_report()` counts) at two points:
*at the peak*, after the last backward of a step and before the optimizer step (the table), and
*between steps*, after the step: stages 2-3 have freed their gradient shard then
(``between_steps=True``); stages 0-1 keep their zeroed gradient buffer. Not resident, and not in
these formulas: the step's transient fp32 copy of one bucket's gradient (4 bytes x the largest
bucket shard), the optimizer's own temporaries, stage 3's gathered units (`working_set_bytes`),
activations (`activation_bytes`) and allocator caches.

With ``offload=True`` the master weights, Adam state and an fp32 gradient shard (4 P/N, as CPU
Adam reads it; freed at the step) are host memory; with ``offload_param=True`` (stage 3) so are
the parameter shards (``host_params``, b P/N), and in fp32 the master weights are then a separate
copy (4 P/N). Padding (at most ``8 N`` elements per bucket) and small persistent parameters under
stage 3 come on top.
"""

from __future__ import annotations

from dataclasses import dataclass

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def model_state_bytes(
    num_params: int,
    dp_size: int,
    stage: int,
    precision: str = "bf16",
    offload: bool = False,
    optimizer_bytes_per_param: int = 8,
    gradient_accumulation_steps: int = 1,
    between_steps: bool = False,
    offload_param: bool = False,
    storage_16bit: bool = False,
    optimizer_states_16bit: bool = False,
) -> dict[str, float]:
    """Estimated bytes per rank by kind, named as in `ZeroEngine.memory_report`, at the
    model-state peak (or, ``between_steps``, after the optimizer step). ``offload_param``
    (stage 3) moves the parameter shards to ``host_params``. ``storage_16bit``
    (``master_weights_dtype`` and ``optimizer_states_dtype`` bf16, bf16 runs): on the device
    the parameters are the master (a bf16 copy of them where they are offloaded), offloaded
    the host keeps a bf16 master, and the optimizer state is kept in half the bytes.
    ``optimizer_states_16bit`` (``optimizer_states_dtype`` alone, bf16 runs; on the device or
    offloaded to the host): the optimizer state in half the bytes."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage = {stage!r}; allowed: 0, 1, 2, 3")
    if precision not in BYTES:
        raise ValueError(f"precision = {precision!r}; allowed: {', '.join(BYTES)}")
    P, N, b = float(num_params), float(dp_size), BYTES[precision]
    shard = P if stage == 0 else P / N
    # Stages 0-1: the whole gradient buffer, reduced in place. Stages 2-3: the reduced shard in
    # the compute dtype; fp32 across an accumulation window (exact sums), none between steps.
    shard_grad = (b if gradient_accumulation_steps == 1 else 4) * shard
    grads = b * P if stage < 2 else (0.0 if between_steps else shard_grad)
    report = {
        "params": b * (P / N if stage == 3 else P),
        "grads": grads,
        # fp32: the parameters themselves, unless they are offloaded (then a device copy)
        "master_weights": 0.0 if precision == "fp32" and not offload_param else 4 * shard,
        "optimizer_states": optimizer_bytes_per_param * shard,
    }
    if storage_16bit:
        if precision != "bf16":
            raise ValueError("storage_16bit needs precision bf16")
        # The bf16 parameters are the master, unless they are offloaded (then a bf16 copy).
        report["master_weights"] = 2 * shard if offload_param else 0.0
    if storage_16bit or optimizer_states_16bit:
        if precision != "bf16":
            raise ValueError("optimizer_states_16bit needs precision bf16")
        report["optimizer_states"] /= 2
    kinds = ("host_params", "host_grads", "host_master_weights", "host_optimizer_states")
    host = dict.fromkeys(kinds, 0.0)
    if offload_param:
        if stage != 3:
            raise ValueError("offload_param needs stage 3")
        host["host_params"], report["params"] = report["params"], 0.0
    if offload:
        if stage == 0:
            raise ValueError("offload needs stage 1, 2 or 3")
        host["host_grads"] = 0.0 if between_steps else 4 * shard  # fp32, as CPU Adam reads it
        host["host_master_weights"] = (2 if storage_16bit else 4) * shard
        host["host_optimizer_states"] = report["optimizer_states"]
        report["grads"] = b * P if stage < 2 else 0.0  # the device shard goes to the host
        report["master_weights"] = 0.0
        report["optimizer_states"] = 0.0
    report.update(host)
    report["total"] = report["params"] + report["grads"] + report["master_weights"]
    report["total"] += report["optimizer_states"]
    report["host_total"] = sum(host.values())
    return report


# ----------------------------------------------------------------------------------------------
# whole-model estimates: tensor parallelism, ZeRO++ / MixZ++, working set, activations
# ----------------------------------------------------------------------------------------------

PAPER_FORMULA = {0: "16P", 1: "4P + 12P/N", 2: "2P + 14P/N", 3: "16P/N"}
"""The ZeRO paper's per-rank model states (mixed precision, Adam), for reference."""


def formula(
    stage: int,
    precision: str = "bf16",
    offload: bool = False,
    gradient_accumulation_steps: int = 1,
    offload_param: bool = False,
    storage_16bit: bool = False,
    optimizer_states_16bit: bool = False,
) -> str:
    """hf_zero's device model states for ``stage`` as text (``"2P + 14P/N"``), read off
    `model_state_bytes` itself so the two cannot disagree."""
    kw = dict(gradient_accumulation_steps=gradient_accumulation_steps, offload_param=offload_param)
    kw.update(storage_16bit=storage_16bit, optimizer_states_16bit=optimizer_states_16bit)
    one = model_state_bytes(1, 1, stage, precision, offload, **kw)
    two = model_state_bytes(1, 2, stage, precision, offload, **kw)
    one, two = one["total"], two["total"]
    per_n = 2 * (one - two)  # total = a P + c P/N
    whole = one - per_n
    terms = [f"{whole:g}P"] if whole else []
    terms += [f"{per_n:g}P/N"] if per_n else []
    return " + ".join(terms) or "0"


WHY_NOT_PAPER = (
    "hf_zero's column is the ZeRO paper's for bf16/fp16: gradients stay 16-bit until the optimizer "
    "step converts one bucket at a time to fp32 (a transient of 4 bytes x the largest bucket "
    "shard, not counted). Resident = held at the model-state peak, after the last backward and "
    "before the step; between steps stages 2-3 hold no gradient shard (2P/N less). Kept on "
    "purpose: with gradient accumulation (--gradient-accumulation-steps > 1) stages 2-3 sum "
    "micro-batches in an fp32 gradient shard from the second micro-batch to the step (+2P/N, "
    "exact accumulation); offload keeps that fp32 shard in host memory. The paper has no fp32 "
    "column; in fp32 compare against hf_zero's only (there the master weights are the "
    "parameters themselves, no copy, unless offloaded)."
)
"""Where `formula` equals `PAPER_FORMULA`, where it keeps more and why (``hf-zero estimate``)."""

QUANT_SCALE_OVERHEAD = 4 / 256  # one fp32 scale per 256-element block
FROZEN_FORMAT_BYTES = {"int8": 1 + QUANT_SCALE_OVERHEAD, "nf4": 0.5 + 4 / 64, "fp4": 0.5 + 4 / 64}
"""Bytes per frozen parameter: MixZ++'s INT8 blocks (stage 3 only), or a bitsandbytes 4-bit base
(codes and one fp32 absmax per 64 values; at every stage, sharded at stage 3)."""


@dataclass
class ModelShape:
    """What the estimator needs to know about a model (counts in elements)."""

    params: int
    tp_split_params: int = 0
    """Parameters AutoTP splits across the TP ranks (the rest is replicated)."""
    largest_unit_params: int = 0
    """The biggest ZeRO-3 unit (a decoder layer): gathered whole while it runs."""
    hidden: int = 0
    layers: int = 0
    heads: int = 0
    embedding_params: int = 0
    """The input embedding (a pipeline's first stage holds it, the last its head's size)."""
    root_unit_params: int = 0
    """What no layer unit holds (embeddings, final norm, an untied head): stage 3's root
    unit, gathered from the forward's start to the backward's end."""
    vocab: int = 0
    intermediate: int = 0
    """The MLP's inner width (the tiled-MLP estimate)."""


def shape_of(model) -> ModelShape:
    """Count a (meta-device) model: parameters, TP-split parameters, the largest unit."""
    from hf_zero.sharding.stage3.units import assign_params_to_units, find_units
    from hf_zero.sharding.tp import EMBEDDING_STYLES, LINEAR_STYLES, resolve_plan

    unique = {id(p): p for p in model.parameters()}
    modules = dict(model.named_modules())
    split = {}
    for name, style in resolve_plan(model).items():
        module = modules[name]
        if style in LINEAR_STYLES or style in EMBEDDING_STYLES:
            split[id(module.weight)] = module.weight.numel()
            bias = getattr(module, "bias", None)
            if bias is not None and LINEAR_STYLES.get(style, (1,))[0] == 0:
                split[id(bias)] = bias.numel()
    units = find_units(model)
    owner = assign_params_to_units(model, [m for _, m in units])
    per_unit: dict[int, int] = {}
    for p in unique.values():
        per_unit[owner[id(p)]] = per_unit.get(owner[id(p)], 0) + p.numel()
    layers = {i: n for i, n in per_unit.items() if i != 0}
    config = getattr(model, "config", None)
    return ModelShape(
        params=sum(p.numel() for p in unique.values()),
        tp_split_params=sum(split.values()),
        largest_unit_params=max(layers.values(), default=per_unit.get(0, 0)),
        hidden=getattr(config, "hidden_size", 0) or 0,
        layers=getattr(config, "num_hidden_layers", 0) or 0,
        heads=getattr(config, "num_attention_heads", 0) or 0,
        embedding_params=model.get_input_embeddings().weight.numel()
        if hasattr(model, "get_input_embeddings")
        else 0,
        root_unit_params=per_unit.get(0, 0) if layers else 0,
        vocab=getattr(config, "vocab_size", 0) or 0,
        intermediate=getattr(config, "intermediate_size", 0) or 0,
    )


def estimate(
    shape: ModelShape,
    dp_size: int,
    stage: int,
    precision: str = "bf16",
    offload: bool = False,
    tp_size: int = 1,
    hpz: int = 1,
    frozen_params: int = 0,
    mixz: bool | str = False,
    gradient_accumulation_steps: int = 1,
    between_steps: bool = False,
    offload_param: bool = False,
    storage_16bit: bool = False,
    optimizer_states_16bit: bool = False,
) -> dict[str, float]:
    """Per-rank bytes by kind (as `ZeroEngine.memory_report` names them) for a whole model.

    ``frozen_params`` have no gradients or optimizer state (a LoRA base); with ``mixz`` (True or
    ``"int8"``, stage 3) they are INT8 shards (1 byte per parameter / N, plus scales); with
    ``"nf4"``/``"fp4"`` a bitsandbytes 4-bit base (`FROZEN_FORMAT_BYTES`). With ``tp_size`` > 1 the
    TP-split part of every count is divided by it. ``hpz`` adds the secondary shards held during a
    step. ``gradient_accumulation_steps`` and ``between_steps``: see `model_state_bytes`.
    """
    b = BYTES[precision]
    local = shape.params - shape.tp_split_params + shape.tp_split_params / tp_size
    frozen = frozen_params * local / shape.params if shape.params else 0.0
    report = model_state_bytes(
        local - frozen,
        dp_size,
        stage,
        precision,
        offload,
        gradient_accumulation_steps=gradient_accumulation_steps,
        between_steps=between_steps,
        offload_param=offload_param,
        storage_16bit=storage_16bit,
        optimizer_states_16bit=optimizer_states_16bit,
    )
    kind = "int8" if mixz is True else mixz or None
    if kind is not None and kind not in FROZEN_FORMAT_BYTES:
        raise ValueError(
            f"hf_zero estimate: 'mixz' = {kind!r}; use one of {', '.join(FROZEN_FORMAT_BYTES)}"
        )
    # MixZ++ needs stage 3 (below it the base is replicated); a bitsandbytes base is quantized
    # at every stage and sharded at stage 3.
    mixz = kind is not None and (stage == 3 or kind != "int8")
    if mixz:
        per_param = FROZEN_FORMAT_BYTES[kind]
        report["quantized_params"] = per_param * (frozen / dp_size if stage == 3 else frozen)
    else:
        frozen_kind = "host_params" if offload_param else "params"  # frozen shards follow
        report[frozen_kind] += b * (frozen / dp_size if stage == 3 else frozen)
    secondary = 0.0
    if stage == 3 and hpz > 1:  # hpZ: 1/hpz of every gathered parameter, INT8 for MixZ++
        frozen_b = FROZEN_FORMAT_BYTES[kind] if mixz else b
        secondary = (b * (local - frozen) + frozen_b * frozen) / hpz
    report["secondary_params"] = secondary
    report["total"] = sum(
        report.get(k, 0.0)
        for k in (
            "params",
            "grads",
            "master_weights",
            "optimizer_states",
            "secondary_params",
            "quantized_params",
        )
    )
    report["host_total"] = sum(
        v for k, v in report.items() if k.startswith("host_") and k != "host_total"
    )
    return report


def working_set_bytes(shape: ModelShape, stage: int, precision: str, tp_size: int = 1) -> float:
    """Stage 3 gathers a unit whole: the running one plus one prefetched, the running unit's
    full gradient before its reduce-scatter, and the root unit (embeddings, head) for the whole
    forward and backward, with its full gradient from the head's backward to the end (the root
    is reduced last). Stages 0-2 keep everything whole already."""
    if stage != 3:
        return 0.0
    split_fraction = shape.tp_split_params / shape.params if shape.params else 0.0
    per_rank = 1 - split_fraction + split_fraction / tp_size
    units = 3 * shape.largest_unit_params + 2 * shape.root_unit_params
    return BYTES[precision] * units * per_rank


def activation_bytes(
    shape: ModelShape,
    seq_len: int,
    micro_batch: int,
    precision: str = "bf16",
    checkpointing: bool = False,
    tp_size: int = 1,
) -> float:
    """Activations kept for backward, per rank (Korthikanti et al. 2022, without the attention
    score matrix, which SDPA/flash attention never materialises).

    Per layer ``s b h (10 + 24 / t)`` bytes in 16 bits (twice in fp32). With full activation
    checkpointing only each layer's input (``2 s b h``) is kept, plus one layer's activations
    while it is recomputed.
    """
    s, bsz, h, t = seq_len, micro_batch, shape.hidden, tp_size
    scale = 2 if precision == "fp32" else 1
    per_layer = s * bsz * h * (10 + 24 / t) * scale
    if checkpointing:
        return shape.layers * 2 * s * bsz * h * scale + per_layer
    return shape.layers * per_layer


def infinity_bytes(
    shape: ModelShape,
    dp_size: int,
    precision: str = "bf16",
    offload_param: bool = True,
    param_buffer_count: int = 5,
    optimizer_buffer_count: int = 4,
    prefetch_bucket_size: int = 0,
    param_cache_numel: int = 0,
    optimizer_cache_numel: int = 0,
    optimizer_states_16bit: bool = False,
    master_weights_16bit: bool = False,
) -> dict[str, float]:
    """ZeRO-Infinity per rank (stage 3, ``offload_optimizer: nvme``; ``offload_param: nvme``
    too with ``offload_param``): swap-file bytes by kind (``nvme_*``, as `memory_report()` names
    them, and ``nvme_total``; fp32 parameter shards are kept in their masters' files, 16 bytes
    per element on disk in all), what stays in device memory (``params``: the parameter shards
    unless offloaded; gradients are written out as they are reduced), and the host's I/O
    buffers at their fullest (``host_io_buffers``: the read-ahead of ``param_buffer_count``
    unit shards, and ``optimizer_buffer_count`` tile sets of master, gradient and two Adam
    moments in fp32). ``working_set`` adds stage 3's gathered units (`working_set_bytes`), the
    prefetch budget (``prefetch_bucket_size`` elements in the compute dtype) and one reduction
    in flight.
    ``param_cache_numel`` (``offload_param_max_in_cpu``): that many elements of the rank's
    parameter shards kept in host memory too (``host_param_cache``, counted in the host column,
    an upper bound: only whole shards are cached). ``optimizer_cache_numel``
    (``offload_optimizer_max_in_cpu``): that many elements of the optimizer shard keep master,
    gradient and Adam moments in host memory instead of swap files (``host_optimizer_cache``,
    16 bytes each, also counted in the host column). ``optimizer_states_16bit``
    (``optimizer_states_dtype: bf16``): the Adam moments are 2 bytes each, in their files and
    in the cache (the tile sets stay counted at 4: an upper bound, which covers the tile widened
    for the step). ``master_weights_16bit`` (``master_weights_dtype: bf16``): the master is 2
    bytes an element, in its file and in the cache; bf16 parameters in swap files share it."""
    from hf_zero.optim.streamed_step import DEFAULT_TILE

    P, N, b = float(shape.params), float(dp_size), BYTES[precision]
    unit_shard = shape.largest_unit_params / N
    held = min(float(optimizer_cache_numel), P / N)  # optimizer elements in host memory
    streamed = P / N - held
    moments = 4 if optimizer_states_16bit else 8  # bytes per element for exp_avg, exp_avg_sq
    master = 2 if master_weights_16bit else 4
    # Parameters share the master's file where the master streams from disk in their dtype.
    shared = b == master
    report = {
        "params": 0.0 if offload_param else b * P / N,
        "nvme_params": (b * held if shared else b * P / N) if offload_param else 0.0,
        "nvme_master_weights": master * streamed,
        "nvme_grads": 4 * streamed,
        "nvme_optimizer_states": moments * streamed,
    }
    report["nvme_total"] = sum(v for k, v in report.items() if k.startswith("nvme_"))
    read_ahead = param_buffer_count * b * unit_shard if offload_param else 0.0
    tiles = optimizer_buffer_count * min(DEFAULT_TILE, unit_shard) * 4 * 4 if streamed else 0.0
    report["host_io_buffers"] = read_ahead + tiles
    cache = b * min(float(param_cache_numel), P / N) if offload_param else 0.0
    report["host_param_cache"] = cache
    report["host_optimizer_cache"] = (master + 4 + moments) * held
    report["host_io_buffers"] += cache + report["host_optimizer_cache"]
    # The reduce-scatter output of the reduction in flight (one unit's with reduce_bucket_size
    # `auto`, h^2 elements; more units' with a larger one) until it is written out.
    in_flight = b * unit_shard
    # An upper bound: backward's gathered units and gradients, reads ahead and reductions in
    # flight, and the step's tile sets, as if all were alive at once (measured, the whole-run
    # peak is above either phase's part alone).
    report["working_set"] = (
        working_set_bytes(shape, 3, precision)
        + b * prefetch_bucket_size
        + report["host_io_buffers"]
        + in_flight
    )
    return report


def sequence_bytes(
    shape: ModelShape,
    seq_len: int,
    micro_batch: int,
    precision: str = "bf16",
    sp_size: int = 1,
    checkpointing: bool = False,
    tiled: bool = False,
    logits_tile_tokens: int | str = "auto",
) -> dict[str, float]:
    """Per-rank bytes a micro-batch keeps for backward at ``seq_len`` tokens, split into the
    layers' activations (`activation_bytes` over this rank's ``seq_len / sp_size`` tokens) and
    the logits: the head's output in the compute dtype plus its fp32 copy the cross-entropy
    keeps (``s b V (e + 4)``, ``e`` the compute dtype's bytes, once in fp32). ``tiled``: tiled
    logits (one tile of ``logits_tile_tokens`` tokens, as the run sizes it, and its gradient, at
    a time) and tiled
    MLP (the MLP's three ``s b I`` intermediates for one hidden-size tile of tokens only)."""
    local = -(-seq_len // sp_size)
    element = 4 if precision == "fp32" else 2
    per_token_logits = shape.vocab * (element + (4 if element != 4 else 0))
    activations = activation_bytes(shape, local, micro_batch, precision, checkpointing)
    logits = local * micro_batch * per_token_logits
    if tiled:
        from hf_zero.sequence.tiles import logits_tile_tokens as tile_size

        tile_tokens = tile_size(logits_tile_tokens, shape.vocab)
        logits = 2 * min(tile_tokens, local * micro_batch) * per_token_logits
        layers_holding = 1 if checkpointing else shape.layers
        tile = min(shape.hidden or local, local)
        mlp = 3 * shape.intermediate * micro_batch * element * (local - tile)
        activations = max(activations - layers_holding * mlp, 0)
    return {"activations": activations, "logits": logits, "total": activations + logits}
