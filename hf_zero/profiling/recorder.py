"""`Profiler`: where one rank's memory and time go, step by step, in the user's own run.

Attached by the engine when ``profile: true`` (or ``$HF_ZERO_PROFILE_DIR``, which ``hf-zero
doctor`` sets). The first step is a warm-up and is not recorded; the next ``profile_steps`` are.
For each, the profiler keeps:

* a **timeline** of memory samples, one at every phase boundary: each unit's forward and
  backward (entered, left), each collective the engine issues (a bucket's reduction, a unit's
  gather), the optimizer step. A sample holds the bytes of every object `memory_report()` counts,
  the **activations** autograd holds for backward (`SavedTensorMeter`: the head's ``logits``
  and their loss, the MLPs' ``mlp_activations`` and the rest apart), and what the OS (RSS)
  or the device allocator says is in use. The process's footprint before the first step, less
  the model states (interpreter, libraries, what the build kept) is **runtime**; what neither
  explains is the **allocator cache** where glibc tells (free bytes malloc keeps beyond those
  it kept before the first step) and **other** (temporaries, buffers in flight; negative when
  activations reuse memory the runtime's allocator already held);
* **time by phase** (`hf_zero.observe.clock`): compute, waiting on collectives inside and
  across nodes, quantization, host-device copies, disk I/O, the optimizer; and the time between
  steps (data loading, logging);
* **tokens** per second (the ``input_ids`` each training forward saw), the bytes each rank sent
  inside and across nodes (`comm_stats`), and the OS's own peak (VmHWM, reset at each step).

When the last recorded step ends, each rank writes ``profile_rank<r>.json`` to the profile
folder; `hf_zero.doctor` reads them. ``$HF_ZERO_PROFILE_EXIT=1`` then ends the run (every rank
at the same step), which is how ``hf-zero doctor -- <command>`` profiles a few steps of a long
job.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from hf_zero.observe import clock
from hf_zero.profiling.activations import REST, SavedTensorMeter
from hf_zero.profiling.process_memory import PeakWatch, measured_bytes, pooled, reset_peak
from hf_zero.sequence import causal_lm
from hf_zero.sharding.stage3.units import find_units, true_numel

logger = logging.getLogger(__name__)

ENV_DIR = "HF_ZERO_PROFILE_DIR"
ENV_STEPS = "HF_ZERO_PROFILE_STEPS"
ENV_EXIT = "HF_ZERO_PROFILE_EXIT"
TOTALS = ("total", "host_total", "nvme_total")
PARTS = {REST: "activations", "mlp": "mlp_activations", "logits": "logits"}
"""The meter's parts, as the profile's objects call them."""
PROFILED_SETTINGS = (
    "stage", "precision", "offload_optimizer", "offload_param", "quantized_weights",
    "hpz_partition_size", "quantized_gradients", "quantized_nontrainable_weights", "tp_size",
    "gradient_accumulation_steps", "train_micro_batch_size_per_gpu", "sp_size", "tiled_logits",
    "tiled_mlp",
)  # fmt: skip
"""The settings a profile records (what the doctor's recommendations start from)."""


def profile_settings(config) -> tuple[Path, int] | None:
    """(folder, steps) when this run is profiled: the config's ``profile``, or the environment
    ``hf-zero doctor`` sets; else None."""
    folder = os.environ.get(ENV_DIR)
    if folder:
        return Path(folder), int(os.environ.get(ENV_STEPS, config.profile_steps))
    if config.profile:
        return Path(config.profile_dir), config.profile_steps
    return None


class Profiler:
    """Records one rank's profile (see the module docstring). ``engine`` needs ``module``,
    ``config``, ``topology``, ``comm`` and ``memory_report()``."""

    def __init__(self, engine, folder: Path, steps: int) -> None:
        self.engine, self.folder, self.steps = engine, Path(folder), steps
        self.rank = engine.topology.rank
        self.device = getattr(engine, "device", torch.device("cpu"))
        self.meter = SavedTensorMeter()
        self.watch: PeakWatch | None = None
        self.seen = 0  # optimizer steps finished (the first is the warm-up)
        self.records: list[dict] = []
        self.current: dict | None = None
        self.clock: clock.PhaseClock | None = None
        self.done = False
        self.metrics: dict[str, float] = {}
        """After the last recorded step: the summary a Trainer logs (``profile/...``)."""
        self.logged = False
        self.defer_exit = False
        """Set by the Trainer: it ends the run itself, after logging ``metrics``."""
        self.exit_requested = os.environ.get(ENV_EXIT) == "1"
        self._last_end = None
        # The process before any step (interpreter, libraries, what building the engine kept):
        # measured now, when the model states are the only objects.
        objects, measured = self._held(), measured_bytes(self.device)
        self.runtime = measured["total"] - sum(pooled(objects, self.device.type).values())
        self.runtime_allocator_free = measured.get("allocator_free")
        self._handles = [engine.module.register_forward_pre_hook(self._root_pre, with_kwargs=True)]
        self._handles.append(engine.module.register_forward_hook(self._root_post))
        for name, module in find_units(engine.module)[1:]:
            self._handles.append(module.register_forward_pre_hook(self._unit_pre(name)))
            self._handles.append(module.register_forward_hook(self._unit_post(name)))
        self._label_parts(engine.module)

    def _label_parts(self, model: torch.nn.Module) -> None:
        """Count what the MLPs save as ``mlp``, and from the head on (its output, the loss) as
        ``logits``: the model's forward ends with the loss, so the part lasts until it ends."""
        for name, module in model.named_modules():
            if name.split(".")[-1] == "mlp":
                self._handles.append(module.register_forward_pre_hook(self._part("mlp")))
                self._handles.append(module.register_forward_hook(self._part(REST)))
        try:
            head = causal_lm(model).get_output_embeddings()
        except ValueError:
            return
        if head is not None:
            self._handles.append(head.register_forward_pre_hook(self._part("logits")))
            self._handles.append(head.register_forward_hook(self._hold_logits))

    def _part(self, part: str):
        def hook(module, args, output=None):
            self.meter.part = part

        return hook

    def _hold_logits(self, module, args, output) -> None:
        if self.meter.counting and torch.is_tensor(output):
            self.meter.hold(output, "logits")

    @property
    def recording(self) -> bool:
        return 1 <= self.seen <= self.steps

    # --- hooks -----------------------------------------------------------------------------
    def _root_pre(self, module, args, kwargs) -> None:
        if not (self.recording and module.training and torch.is_grad_enabled()):
            return
        if self.current is None:
            self._begin_step()
        ids = kwargs.get("input_ids", args[0] if args and torch.is_tensor(args[0]) else None)
        if torch.is_tensor(ids):
            self.current["tokens"] += ids.numel()
            self.current["micro_batch"] = ids.shape[0] if ids.dim() > 1 else 1
            self.current["micro_batches"] += 1
        self.meter.part = REST
        self.meter.enter()
        self.sample("forward")

    def _root_post(self, module, args, output) -> None:
        if self.current is not None and self.meter.counting:
            self.meter.exit()
            self.meter.part = REST
            self.sample("forward done")

    def _unit_pre(self, name: str):
        def hook(module, args):
            if self.current is None or not torch.is_grad_enabled():
                return
            self.sample(f"forward {name}")
            for t in args:
                if torch.is_tensor(t) and t.requires_grad:
                    t.register_hook(self._grad_hook(f"backward {name} done"))
                    break

        return hook

    def _unit_post(self, name: str):
        def hook(module, args, output):
            if self.current is None or not torch.is_grad_enabled():
                return
            self.sample(f"forward {name} done")
            first = output[0] if isinstance(output, tuple) else output
            if torch.is_tensor(first) and first.requires_grad:
                first.register_hook(self._grad_hook(f"backward {name}"))

        return hook

    def _grad_hook(self, event: str):
        def hook(grad):
            if self.current is not None:
                self.sample(event)

        return hook

    # --- samples ---------------------------------------------------------------------------
    def _held(self) -> dict[str, int]:
        """`memory_report()`'s kinds that hold bytes now, without its totals."""
        report = self.engine.memory_report()
        return {k: v for k, v in report.items() if v and k not in TOTALS}

    def sample(self, event: str) -> None:
        """A memory sample at this moment (also a listener of the phase clock's marks)."""
        if self.current is None:
            return
        objects = self._held()
        objects["activations"] = 0
        for part, nbytes in self.meter.by_part.items():
            objects[PARTS[part]] = nbytes
        measured = measured_bytes(self.device)
        self.current["timeline"].append(
            {
                "t": time.perf_counter() - self.current["start"],
                "event": event,
                "objects": objects,
                "measured": measured,
            }
        )

    def _begin_step(self) -> None:
        now = time.perf_counter()
        if self.clock is None:
            self.clock = clock.start()
            self.clock.listeners.append(self.sample)
            self.watch = PeakWatch(self.device, lambda: len(self.current["timeline"]) - 1)
        self.current = {
            "step": self.seen,
            "start": now,
            "between_steps_s": now - self._last_end if self._last_end else None,
            "tokens": 0,
            "micro_batch": None,
            "micro_batches": 0,
            "timeline": [],
            "phases_before": self.clock.snapshot(),
            "comm_before": _link_bytes(self.engine.comm.stats),
        }
        reset_peak(self.device)
        self.meter.reset_peak()
        self.sample("step start")
        self.watch.reset()

    def after_step(self) -> None:
        """The optimizer step finished (the engine calls this once per optimizer step)."""
        if self.current is not None:
            self.sample("optimizer step done")
            self._add_watched_peak()
            self._end_step()
        self.seen += 1
        if self.seen == self.steps + 1:
            self._finish()

    def _add_watched_peak(self) -> None:
        """The watch thread's highest reading, when above every boundary sample: a sample of
        its own, with the objects of the boundary before it."""
        timeline, watch = self.current["timeline"], self.watch
        if watch.at is None or watch.high <= max(s["measured"]["total"] for s in timeline):
            return
        when, index = watch.at
        before = timeline[max(0, index)]
        timeline.append(
            {
                "t": when - self.current["start"],
                "event": f"after '{before['event']}' (between boundaries)",
                "objects": dict(before["objects"]),
                "measured": watch.measured,
            }
        )
        timeline.sort(key=lambda s: s["t"])

    def _end_step(self) -> None:
        cur, self.current = self.current, None
        end = time.perf_counter()
        self._last_end = end
        wall = end - cur["start"]
        phases = _diff(self.clock.snapshot(), cur.pop("phases_before"))
        phases["compute"] = max(0.0, wall - sum(phases.values()))
        comm = _link_bytes(self.engine.comm.stats)
        cur.update(
            wall_s=wall,
            phases_s=phases,
            tokens_per_s=cur["tokens"] / wall if wall > 0 else 0.0,
            sent_bytes={k: max(0, comm[k] - cur["comm_before"][k]) for k in comm},
            os_peak=measured_bytes(self.device, peak=True),
            runtime_bytes=self.runtime,
            runtime_allocator_free=self.runtime_allocator_free,
            activation_peak=self.meter.peak,
            activation_peaks={PARTS[k]: v for k, v in self.meter.peak_by_part.items()},
        )
        del cur["comm_before"], cur["start"]
        self.records.append(cur)

    def _finish(self) -> None:
        clock.stop()
        if self.watch is not None:
            self.watch.stop()
        self.meter.exit()
        for handle in self._handles:
            handle.remove()
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"profile_rank{self.rank}.json"
        tmp = path.with_name(path.name + ".partial")
        tmp.write_text(json.dumps(self.summary(), indent=1) + "\n")
        os.replace(tmp, path)
        if self.rank == 0:
            print(
                f"hf_zero: profiled {len(self.records)} steps; wrote {self.folder}/"
                "profile_rank*.json (read it with: hf-zero doctor --profile "
                f"{self.folder})",
                file=sys.stderr,
                flush=True,
            )
        self.done = True
        self.metrics = _log_metrics(self.records)
        if self.exit_requested and not self.defer_exit:
            self.exit()

    def exit(self) -> None:
        """End the run here, on every rank (each calls it at the same step)."""
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        raise SystemExit(0)

    def summary(self) -> dict[str, Any]:
        """What ``profile_rank<r>.json`` holds."""
        engine, topo = self.engine, self.engine.topology
        config = engine.config
        return {
            "rank": self.rank,
            "world_size": topo.world_size,
            "ranks_per_node": getattr(topo, "node_size", None) or topo.world_size,
            "device": self.device.type,
            "pools": "one" if self.device.type == "cpu" else "device+host",
            "config": {k: getattr(config, k, None) for k in PROFILED_SETTINGS},
            "model": _model_facts(engine.module),
            "steps": self.records,
        }


def _log_metrics(records: list[dict]) -> dict[str, float]:
    """This rank's profile in a few numbers (a Trainer logs them; TensorBoard shows them)."""
    peak_step, peak = max(
        ((r, s) for r in records for s in r["timeline"]), key=lambda rs: rs[1]["measured"]["total"]
    )
    walls = sorted(r["wall_s"] for r in records)
    median = next(r for r in records if r["wall_s"] == walls[(len(walls) - 1) // 2])
    out = {
        "profile/peak_MiB": peak["measured"]["total"] / 2**20,
        "profile/os_peak_MiB": peak_step["os_peak"]["total"] / 2**20,
        "profile/step_ms": median["wall_s"] * 1000,
        "profile/tokens_per_s": median["tokens_per_s"],
    }
    for phase, seconds in median["phases_s"].items():
        out[f"profile/share_{phase}"] = seconds / median["wall_s"]
    for kind, nbytes in peak["objects"].items():
        out[f"profile/peak_MiB_{kind}"] = nbytes / 2**20
    return {k: round(v, 4) for k, v in out.items()}


def _diff(now: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: now.get(k, 0.0) - before.get(k, 0.0) for k in clock.PHASES if k != "compute"}


COMM_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast")


def _link_bytes(stats) -> dict[str, int]:
    """Bytes this rank has sent, inside its node and across nodes (every purpose), and across
    nodes per kind of collective (what ZeRO++ would shrink)."""
    out = {
        "intra_node": stats.wire_bytes(inter_node=False),
        "inter_node": stats.wire_bytes(inter_node=True),
    }
    out.update({f"inter_node.{k}": stats.wire_bytes(k, inter_node=True) for k in COMM_KINDS})
    return out


def _model_facts(model: torch.nn.Module) -> dict[str, Any]:
    config = getattr(model, "config", None)
    units = find_units(model)
    return {
        "parameters": sum(true_numel(p) for p in model.parameters()),
        "trainable": sum(true_numel(p) for p in model.parameters() if p.requires_grad),
        "units": len(units) - 1,
        **{
            key: getattr(config, key, None)
            for key in (
                "hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size",
                "num_attention_heads", "num_key_value_heads",
            )
        },
    }  # fmt: skip
