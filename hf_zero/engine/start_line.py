"""The line an engine prints when it starts: what runs where, in words."""

from __future__ import annotations


def describe(engine) -> str:
    """Stage, ranks, precision and what is switched on, comma-separated."""
    config, topo, zpp = engine.config, engine.topology, engine.zeropp
    parts = [
        f"stage {config.stage} over {topo.dp_size} data-parallel rank"
        + ("s" if topo.dp_size > 1 else ""),
        config.precision,
        f"{topo.num_nodes} node(s) of {topo.node_size} rank(s)",
        f"{len(engine.groups)} trainable buckets"
        if engine.groups
        else "evaluation only (no trainable parameters)",
    ]
    if engine.tp:
        parts.insert(3, f"tensor parallel {topo.tp_size} (AutoTP, {len(engine.tp.plan)} modules)")
    parts += engine.sequence.describe() if engine.sequence is not None else []
    if config.offload_optimizer != "none":
        parts.append(_optimizer_offload(config, engine.groups))
    if config.offload_param != "none":
        parts.append(f"parameter shards offloaded to {config.offload_param}")
    if zpp.quantized_weights:
        parts.append(f"qwZ INT{zpp.weight_bits} weight gather")
    if zpp.hpz is not None:
        parts.append(f"hpZ secondary partition over {zpp.hpz.size} ranks")
    if zpp.quantized_gradients:
        ef = " with error feedback" if zpp.error_feedback else ""
        parts.append(f"qgZ INT{zpp.gradient_bits} gradient all-to-all{ef}")
    if zpp.quantized_nontrainable_weights:
        frozen = sum(g.numel for g in engine.frozen_groups)
        kind = f"INT{zpp.weight_bits}" if zpp.frozen_format == "int" else zpp.frozen_format
        parts.append(f"MixZ++ {kind.upper()} frozen weights ({frozen} elements)")
    return ", ".join(parts)


def _optimizer_offload(config, groups: list) -> str:
    """Where the optimizer went, and which share stayed in host memory when only part did
    (``offload_optimizer_ratio`` on cpu, ``offload_optimizer_max_in_cpu`` on nvme)."""
    host = [g for g in groups if g.master_weights.location == "host"]
    share = sum(g.numel for g in host) / max(1, sum(g.numel for g in groups))
    split = f"{len(host)} of {len(groups)} buckets, {share:.0%} of the elements"
    ratio = config.offload_optimizer_ratio
    if config.offload_optimizer == "cpu" and ratio < 1.0:
        return f"optimizer offloaded to cpu in part (ratio {ratio}: {split})"
    if config.offload_optimizer == "nvme" and host:
        return f"optimizer offloaded to nvme, part kept in host memory ({split})"
    return f"optimizer offloaded to {config.offload_optimizer}"
