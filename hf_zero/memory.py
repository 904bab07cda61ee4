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
