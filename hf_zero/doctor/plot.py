"""The doctor's picture: memory by object over one step, with the phases marked, and where the
step's time goes."""

from __future__ import annotations

from pathlib import Path

from hf_zero.doctor.diagnosis import KIND_NAMES, Diagnosis


def plot(d: Diagnosis, path: str | Path) -> Path:
    """Write the PNG (matplotlib, without a display) and return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times = [s["t"] * 1000 for s in d.timeline]
    kinds = sorted({k for s in d.timeline for k in s["makeup"]} - {"runtime", "other"})
    layers = {
        kind: [max(0, s["makeup"].get(kind, 0)) / 2**20 for s in d.timeline]
        for kind in ["runtime", *kinds, "other"]
    }
    fig, (mem, bar) = plt.subplots(2, 1, figsize=(11, 7), height_ratios=[3, 1])
    mem.stackplot(times, *layers.values(), labels=[KIND_NAMES.get(k, k) for k in layers])
    mem.plot(times, [s["measured"]["total"] / 2**20 for s in d.timeline], "k.", ms=3,
             label="measured (OS / allocator)")  # fmt: skip
    for s, t in zip(d.timeline, times):
        if s["event"].startswith(("forward model", "backward model")) or "optimizer" in s["event"]:
            mem.axvline(t, color="grey", lw=0.3)
    mem.set_xlabel("ms into the step")
    mem.set_ylabel("MiB")
    mem.set_title(f"Memory by object, rank {d.rank}, one step (peak at '{d.event}')")
    floor = d.makeup.get("runtime", 0) / 2**20  # the runtime: show what moves above it
    mem.set_ylim(bottom=floor * 0.9)
    mem.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    left = 0.0
    for phase, seconds in sorted(d.phases_s.items(), key=lambda kv: -kv[1]):
        if seconds > 0:
            bar.barh(0, seconds * 1000, left=left, label=f"{phase} {seconds * 1000:.0f} ms")
            left += seconds * 1000
    bar.set_yticks([])
    bar.set_xlabel("ms")
    bar.set_title("Where the step's time goes")
    bar.legend(loc="upper left", fontsize=7, ncol=4)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
