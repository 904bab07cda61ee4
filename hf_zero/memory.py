"""Per-rank model-state memory of each ZeRO stage: the formulas `memory_report()` is held to.

For ``P`` trainable parameters on ``N`` data-parallel ranks with Adam (8 bytes of state per
parameter), hf_zero holds, per rank:

=====  ==============  =================  ===================  ============
stage  parameters      gradients          fp32 master weights  Adam state
=====  ==============  =================  ===================  ============
0      b P             b P + 4 P          4 P (0 in fp32)      8 P
1      b P             b P + 4 P/N        4 P/N                8 P/N
2      b P             4 P/N              4 P/N                8 P/N
3      b P/N           4 P/N              4 P/N (0 in fp32)    8 P/N
=====  ==============  =================  ===================  ============

``b`` is the compute dtype's size (2 for bf16/fp16, 4 for fp32). Gradient shards are fp32 (the
ZeRO paper assumes 16-bit gradients: 2P + 14P/N for stage 2 where hf_zero has 2P + 16P/N).
With ``offload=True`` the gradient shard, master weights and Adam state are host memory. Padding
(at most ``8 N`` elements per bucket) and small persistent parameters under stage 3 come on top.
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
) -> dict[str, float]:
    """Estimated bytes per rank by kind, named as in `ZeroEngine.memory_report`."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage = {stage!r}; allowed: 0, 1, 2, 3")
    if precision not in BYTES:
        raise ValueError(f"precision = {precision!r}; allowed: {', '.join(BYTES)}")
    P, N, b = float(num_params), float(dp_size), BYTES[precision]
    shard = P if stage == 0 else P / N
    report = {
        "params": b * (P / N if stage == 3 else P),
        "grads": b * P + 4 * shard if stage < 2 else 4 * shard,
        "master_weights": 0.0 if precision == "fp32" and stage in (0, 3) else 4 * shard,
        "optimizer_states": optimizer_bytes_per_param * shard,
    }
    if stage == 0 and precision == "fp32":
        report["grads"] = b * P  # the master gradient is the flat gradient itself
    # Stage 0-1 gradients: the full 16-bit buffer plus the fp32 (shard) gradient after reduction.
    host = dict.fromkeys(("host_grads", "host_master_weights", "host_optimizer_states"), 0.0)
    if offload:
        if stage == 0:
            raise ValueError("offload needs stage 1, 2 or 3")
        host["host_grads"] = 4 * shard
        host["host_master_weights"] = 4 * shard
        host["host_optimizer_states"] = report["optimizer_states"]
        report["grads"] -= 4 * shard
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


def formula(stage: int, precision: str = "bf16", offload: bool = False) -> str:
    """hf_zero's device model states for ``stage`` as text (``"2P + 16P/N"``), read off
    `model_state_bytes` itself so the two cannot disagree."""
    one = model_state_bytes(1, 1, stage, precision, offload)["total"]
    two = model_state_bytes(1, 2, stage, precision, offload)["total"]
    per_n = 2 * (one - two)  # total = a P + c P/N
    whole = one - per_n
    terms = [f"{whole:g}P"] if whole else []
    terms += [f"{per_n:g}P/N"] if per_n else []
    return " + ".join(terms) or "0"


WHY_NOT_PAPER = (
    "Why hf_zero's column is above the ZeRO paper's (16-bit gradients): each rank keeps its "
    "reduced gradient shard in fp32 until the optimizer step, so micro-batches accumulate "
    "exactly. Stages 2-3 hold it instead of a 16-bit shard (+2P/N), stage 1 next to the whole "
    "16-bit gradient (+4P/N), stage 0 as an fp32 copy of the whole gradient (+4P). The paper's "
    "formulas assume bf16/fp16; in fp32 compare against hf_zero's column only."
)
"""Why `formula` differs from `PAPER_FORMULA` (printed by ``hf-zero estimate``)."""

QUANT_SCALE_OVERHEAD = 4 / 256  # one fp32 scale per 256-element block


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


def shape_of(model) -> ModelShape:
    """Count a (meta-device) model: parameters, TP-split parameters, the largest unit."""
    from hf_zero.stage3 import assign_params_to_units, find_units
    from hf_zero.tp import EMBEDDING_STYLES, LINEAR_STYLES, resolve_plan

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
    mixz: bool = False,
) -> dict[str, float]:
    """Per-rank bytes by kind (as `ZeroEngine.memory_report` names them) for a whole model.

    ``frozen_params`` have no gradients or optimizer state (a LoRA base); with ``mixz`` (stage
    3) they are INT8 shards (1 byte per parameter / N, plus scales). With ``tp_size`` > 1 the TP-split part
    of every count is divided by it. ``hpz`` adds the secondary shards held during a step.
    """
    b = BYTES[precision]
    local = shape.params - shape.tp_split_params + shape.tp_split_params / tp_size
    frozen = frozen_params * local / shape.params if shape.params else 0.0
    report = model_state_bytes(local - frozen, dp_size, stage, precision, offload)
    mixz = mixz and stage == 3  # MixZ++ needs stage 3; below it the base is replicated
    if mixz:
        report["quantized_params"] = frozen / dp_size * (1 + QUANT_SCALE_OVERHEAD)
    else:
        report["params"] += b * (frozen / dp_size if stage == 3 else frozen)
    secondary = 0.0
    if stage == 3 and hpz > 1:  # hpZ: 1/hpz of every gathered parameter, INT8 for MixZ++
        secondary = (b * (local - frozen) + (1 if mixz else b) * frozen) / hpz
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
    return report


def working_set_bytes(shape: ModelShape, stage: int, precision: str, tp_size: int = 1) -> float:
    """Stage 3 gathers a unit whole: the running one plus one prefetched, and the running
    unit's full gradient before its reduce-scatter. Stages 0-2 keep everything whole already."""
    if stage != 3:
        return 0.0
    split_fraction = shape.tp_split_params / shape.params if shape.params else 0.0
    unit = shape.largest_unit_params * (1 - split_fraction + split_fraction / tp_size)
    return BYTES[precision] * unit * 3


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
