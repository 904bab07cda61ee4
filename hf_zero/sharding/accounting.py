"""Bytes a rank's groups and loose parameters hold now, by the kinds `memory_report()` sums: the
measured side of the formulas in `hf_zero.memory`."""

from __future__ import annotations

from hf_zero.numerics.packed import is_packed, packed_bytes


def group_held_bytes(group) -> dict[str, int]:
    """What one `FlatParamGroup` holds now, by the kinds `memory_report()` sums: the measured
    side of the formulas above. ``host_*`` kinds are in host memory (offload), ``nvme_*`` in swap
    files (disk, not memory)."""
    params = _nbytes(group.flat_param) + group.placement.staged_bytes()
    tier = group.tier.held_bytes()
    params += tier.pop("params", 0)  # a device shard; an offloaded one stays "host_params"
    grads = _nbytes(group.flat_grad)
    grads += group.reduce_codec.residual_bytes()  # qgZ error feedback
    extra = {}
    if group.gather_codec.held_bytes():
        extra["secondary_params"] = group.gather_codec.held_bytes()
    if group.master_weights is None:  # frozen
        kinds = {"grads": grads, "master_weights": 0}
    else:
        kinds = group.master_weights.held_bytes(grads, group.flat_grad)
    if getattr(group, "packed", None) is not None:  # bitsandbytes codes: counted apart
        return {**extra, **tier, "params": 0, "quantized_params": params, **kinds}
    return {**extra, **tier, "params": params, **kinds}


def loose_param_bytes(model, grouped: set[int]) -> dict[str, int]:
    """Bytes of the parameters outside any group (frozen ones under stages 0-2, those below
    the persistence threshold) and their gradients, plus every bitsandbytes parameter's
    quantization state (kept whole on every rank) as ``quantized_params``."""
    out = {"params": 0, "grads": 0, "quantized_params": 0}
    for p in model.parameters():
        own = _nbytes(p)
        if is_packed(p):  # codes (whole unless a group holds them) and scales
            out["quantized_params"] += packed_bytes(p) - own + (0 if id(p) in grouped else own)
        elif id(p) not in grouped:
            out["params"] += own
            out["grads"] += _nbytes(p.grad)
    return out


def _nbytes(t) -> int:
    return 0 if t is None else t.numel() * t.element_size()
