"""What a profile says: the peak moment and what it is made of, where the step's time goes, and
how much of it is spent waiting on each link. Reads the ``profile_rank<r>.json`` files that
`hf_zero.profiling.Profiler` writes."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hf_zero.profiling.process_memory import pooled

KIND_NAMES = {
    "params": "parameters",
    "grads": "gradients",
    "master_weights": "fp32 master weights",
    "optimizer_states": "optimizer state",
    "activations": "other activations",
    "mlp_activations": "MLP activations",
    "logits": "logits (the head and its loss)",
    "secondary_params": "hpZ secondary shards",
    "quantized_params": "quantized frozen weights",
    "pooled_params": "gather buffers kept for reuse",
    "host_params": "parameters (host)",
    "host_grads": "gradients (host)",
    "host_master_weights": "fp32 master weights (host)",
    "host_optimizer_states": "optimizer state (host)",
    "allocator_cache": "allocator cache (freed memory malloc keeps)",
    "runtime": "runtime (process before the step)",
    "other": "other (temporaries, buffers in flight)",
}
"""How each object is called in the report."""


def load_profiles(folder: str | Path) -> list[dict]:
    """Every rank's profile in ``folder``, by rank."""
    paths = sorted(Path(folder).glob("profile_rank*.json"))
    if not paths:
        raise FileNotFoundError(
            f"hf_zero doctor: no profile_rank*.json in {folder} (run with --zero_profile true, "
            "or profile_steps steps did not finish)"
        )
    profiles = [json.loads(p.read_text()) for p in paths]
    return sorted(profiles, key=lambda p: p["rank"])


@dataclass
class Diagnosis:
    """The measured facts the report prints and the recommendations start from."""

    rank: int
    step: int
    event: str
    peak_bytes: int
    os_peak_bytes: int
    makeup: dict[str, int]
    """Bytes per object at the peak moment (with ``runtime`` and ``other``): they sum to
    ``peak_bytes``."""
    step_s: float
    phases_s: dict[str, float]
    tokens_per_s: float
    sent_bytes: dict[str, float]
    world_size: int
    ranks_per_node: int
    config: dict[str, Any]
    model: dict[str, Any]
    activations_peak: int
    """What autograd held for backward at its height in the step (every part)."""
    activation_peaks: dict[str, int] = field(default_factory=dict)
    """Each part's own height (``activations``, ``mlp_activations``, ``logits``)."""
    device: str = "cpu"
    micro_batch: int | None = None
    """Sequences per forward, as the recorded steps saw them."""
    micro_batches: int = 1
    """Forwards per optimizer step (gradient accumulation)."""
    tokens_per_step: float = 0.0
    """Tokens every data-parallel replica together trained on in one optimizer step (0: not
    recorded; then ``tokens_per_s * step_s``)."""
    timeline: list[dict] = field(default_factory=list)
    """The median step's samples, each with its ``makeup``."""
    moments: list[dict[str, int]] = field(default_factory=list)
    """The make-up at every sampled moment of the peak rank's recorded steps (the peak's among
    them): a change can move the peak to another moment, so predictions take their highest."""

    @property
    def comm_wait_share(self) -> dict[str, float]:
        return {
            link: self.phases_s.get(f"comm_wait_{link}", 0.0) / self.step_s
            for link in ("intra", "inter")
        }

    @property
    def nodes(self) -> int:
        return max(1, self.world_size // max(1, self.ranks_per_node))

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k not in ("timeline", "moments")}
        out["comm_wait_share"] = self.comm_wait_share
        return out


def diagnose(profiles: list[dict]) -> Diagnosis:
    """The rank and step with the highest measured memory, its make-up, and the median step's
    time breakdown over every recorded step of that rank (tokens per second: all data-parallel
    replicas; the ranks of a tensor-parallel group share theirs)."""
    samples = [(p, st, sa) for p in profiles for st in p["steps"] for sa in st["timeline"]]
    if not samples:
        raise ValueError("hf_zero doctor: the profile holds no recorded step")
    top = max(sa["measured"]["total"] for _, _, sa in samples)
    # Freed memory often stays with the process (the allocator keeps it), so the measured total
    # plateaus at its peak: of the samples on the plateau, the peak moment is the one where the
    # objects held are largest (what put the process there), not a later one holding a cache.
    plateau = [s for s in samples if s[2]["measured"]["total"] >= 0.99 * top]
    profile, step, sample = max(
        plateau, key=lambda s: sum(pooled(s[2]["objects"], s[0]["device"]).values())
    )
    steps = profile["steps"]
    walls = [s["wall_s"] for s in steps]
    median = steps[walls.index(statistics.median_low(walls))]
    tokens = sum(statistics.median(s["tokens_per_s"] for s in p["steps"]) for p in profiles)
    # The ranks of a tensor- or sequence-parallel group each count their replica's tokens.
    tokens /= (profile["config"].get("tp_size") or 1) * (profile["config"].get("sp_size") or 1)
    per_step = sum(p["steps"][0].get("tokens", 0) for p in profiles) / (
        (profile["config"].get("tp_size") or 1) * (profile["config"].get("sp_size") or 1)
    )
    return Diagnosis(
        rank=profile["rank"],
        step=step["step"],
        event=sample["event"],
        peak_bytes=sample["measured"]["total"],
        os_peak_bytes=step["os_peak"]["total"],
        makeup=_makeup(profile, step, sample),
        step_s=median["wall_s"],
        phases_s=median["phases_s"],
        tokens_per_s=tokens,
        sent_bytes=median["sent_bytes"],
        world_size=profile["world_size"],
        ranks_per_node=profile["ranks_per_node"],
        config=profile["config"],
        model=profile["model"],
        activations_peak=max(s["activation_peak"] for s in steps),
        activation_peaks={
            part: max(s.get("activation_peaks", {}).get(part, 0) for s in steps)
            for part in {k for s in steps for k in s.get("activation_peaks", {})}
        },
        device=profile["device"],
        micro_batch=median.get("micro_batch"),
        micro_batches=median.get("micro_batches") or 1,
        tokens_per_step=per_step,
        timeline=[{**sa, "makeup": _makeup(profile, median, sa)} for sa in median["timeline"]],
        moments=[_makeup(profile, st, sa) for st in steps for sa in st["timeline"]],
    )


def _makeup(profile: dict, step: dict, sample: dict) -> dict[str, int]:
    """Bytes per object at ``sample``, with ``runtime``, ``allocator_cache`` (on CPU, where
    glibc tells: the free bytes malloc keeps beyond those it kept before the first step) and
    ``other``: they sum to the sample's measured total."""
    makeup = pooled(sample["objects"], profile["device"])
    runtime = step["runtime_bytes"]
    free, before = sample["measured"].get("allocator_free"), step.get("runtime_allocator_free")
    if profile["device"] == "cpu" and free is not None and before is not None:
        makeup["allocator_cache"] = max(0, free - before)
    other = sample["measured"]["total"] - runtime - sum(makeup.values())
    return {**makeup, "runtime": runtime, "other": other}


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def format_report(d: Diagnosis) -> str:
    """The doctor's printed report (without recommendations)."""
    lines = [
        f"Peak memory: {_mib(d.peak_bytes)} on rank {d.rank}, step {d.step}, at '{d.event}' "
        f"(the OS's own peak that step: {_mib(d.os_peak_bytes)}; sampled peak is "
        f"{100 * d.peak_bytes / max(1, d.os_peak_bytes):.1f}% of it)",
        "",
        "| object | bytes | share |",
        "|---|---:|---:|",
    ]
    for kind, nbytes in sorted(d.makeup.items(), key=lambda kv: -kv[1]):
        share = 100 * nbytes / max(1, d.peak_bytes)
        lines.append(f"| {KIND_NAMES.get(kind, kind)} | {_mib(nbytes)} | {share:.1f}% |")
    lines += [
        "",
        f"Step time: {d.step_s * 1000:.1f} ms (median of the recorded steps), "
        f"{d.tokens_per_s:,.0f} tokens/s over {d.world_size} ranks",
        "",
        "| phase | ms | share |",
        "|---|---:|---:|",
    ]
    for phase, seconds in sorted(d.phases_s.items(), key=lambda kv: -kv[1]):
        if seconds > 0:
            lines.append(f"| {phase} | {seconds * 1000:.1f} | {100 * seconds / d.step_s:.1f}% |")
    wait = d.comm_wait_share
    lines += [
        "",
        f"Waiting on communication: {100 * wait['intra']:.1f}% of the step inside nodes, "
        f"{100 * wait['inter']:.1f}% across nodes; sent per step by rank {d.rank}: "
        f"{_mib(d.sent_bytes.get('intra_node', 0))} inside its node, "
        f"{_mib(d.sent_bytes.get('inter_node', 0))} to other nodes",
    ]
    return "\n".join(lines)
