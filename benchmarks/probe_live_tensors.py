"""Which large tensors are alive in the middle of a ZeRO-3 backward, and who holds each.

    OMP_NUM_THREADS=1 python benchmarks/probe_live_tensors.py --offload nvme

Two ranks (gloo) train a LLaMA-shaped model (``--hidden``, ``--layers``) under stage 3 with
parameters and optimizer on ``--offload`` (``none``, ``cpu`` or ``nvme``). In the second
step's backward, when the gradient reaches the middle decoder layer, every rank lists each
tensor storage alive in the process of at least ``--min_fraction`` of the largest unit's fp32
size (found through ``gc``, plus what autograd saved on the graph), and names its owner: a
group's gathered flat buffer, a gradient bucket or reduction buffer, a swap I/O buffer, an
optimizer or master tensor, an activation autograd saved, or "unknown". Prints one table per
rank and writes ``--out/probe_live_tensors.json``. Used to account for the unit-sized fp32
tensors a backward holds (docs/ARCHITECTURE.md, "What a backward holds").
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import launch_ranks, llama_shape


def storages(min_bytes: int) -> dict[int, dict]:
    """Every tensor storage of at least ``min_bytes`` reachable through ``gc``, by address."""
    import torch

    found: dict[int, dict] = {}
    for obj in gc.get_objects():
        try:
            if not torch.is_tensor(obj) or obj.device.type == "meta":
                continue
            storage = obj.untyped_storage()
        except Exception:  # objects gc sees may be half-built
            continue
        nbytes = storage.nbytes()
        if nbytes >= min_bytes and storage.data_ptr() not in found:
            found[storage.data_ptr()] = {
                "bytes": nbytes,
                "dtype": str(obj.dtype).removeprefix("torch."),
                "shape": list(obj.shape),
            }
    return found


def owners(engine, model) -> dict[int, str]:
    """Storage address -> what in the engine holds it."""
    import torch

    named: dict[int, str] = {}

    def add(tensor, label: str) -> None:
        if torch.is_tensor(tensor) and tensor.numel():
            named.setdefault(tensor.untyped_storage().data_ptr(), label)

    def scan(obj, label: str, held: str | None = None) -> None:
        """Each tensor attribute of ``obj``; with ``held``, also the tensors it keeps in a tuple
        or list attribute (a read in flight, a copy waiting for its write)."""
        for name, value in vars(obj).items() if obj is not None else ():
            add(value, f"{label} {name.strip('_')}")
            for item in value if held and isinstance(value, list | tuple) else ():
                add(item[0] if isinstance(item, tuple) and item else item, held)

    for i, group in enumerate(engine.groups + engine.frozen_groups):
        add(group.flat_param, f"group {i}: gathered flat buffer ({group.layout.slots[0].name})")
        scan(group, f"group {i}:")
        scan(getattr(group, "intake", None), f"group {i}: gradient intake")
        scan(getattr(group, "reduce_codec", None), f"group {i}: reduction in flight,")
        scan(getattr(group, "tier", None), f"group {i}: tier", f"group {i}: tier read-ahead buffer")
        scan(group.master_weights, f"group {i}: master")
        grads = getattr(group.master_weights, "grads", None)
        scan(grads, f"group {i}: gradient store", f"group {i}: gradient store (pending write)")
    for p in model.parameters():
        if p.grad is not None:
            add(p.grad, "a parameter's .grad")
    return named


def _label_transients(engine, labels: dict | None = None) -> dict[int, str]:
    """Buffers no attribute holds (inside an I/O future or a collective's work): label them
    where they are made. Swap buffers by the function that asked for one; reduction inputs by
    their group (call again with the engine once it exists)."""
    from hf_zero.sharding.flat_group import FlatParamGroup
    from hf_zero.storage.swap import SwapSpace

    labels = {} if labels is None else labels
    if engine is None:
        make = SwapSpace.buffer

        def buffer(self, numel, dtype):
            tensor = make(self, numel, dtype)
            caller = sys._getframe(1).f_code.co_qualname
            labels[tensor.untyped_storage().data_ptr()] = f"swap buffer made by {caller}"
            return tensor

        SwapSpace.buffer = buffer
        new_shard = FlatParamGroup._new_shard

        def shard(self, dtype=None):
            tensor = new_shard(self, dtype)
            caller = sys._getframe(1).f_code.co_qualname
            labels[tensor.untyped_storage().data_ptr()] = f"a group's shard made by {caller}"
            return tensor

        FlatParamGroup._new_shard = shard
        return labels
    for i, group in enumerate(engine.groups):
        codec = group.reduce_codec
        if codec is None:
            continue

        def launch(full, output, async_op, _launch=codec.launch, _i=i):
            labels[full.untyped_storage().data_ptr()] = f"group {_i}: gradient being reduced"
            return _launch(full, output, async_op)

        codec.launch = launch
    return labels


def rank_main(args) -> dict:
    import torch
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    import hf_zero
    from hf_zero.tiny import tiny_llama_config

    dist.init_process_group("gloo")
    config = tiny_llama_config(**llama_shape(args.hidden, args.layers, args.vocab, args.seq_len))
    zero = dict(
        stage=3, offload_param=args.offload, offload_optimizer=args.offload,
        nvme_path=args.nvme_path, offload_optimizer_fast_kernel=False,
    )  # fmt: skip
    labels = _label_transients(engine=None)
    torch.manual_seed(0)
    with hf_zero.partitioned_init(**zero):
        model = LlamaForCausalLM(config)
    engine = hf_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), **zero)
    _label_transients(engine, labels)
    unit = max(g.numel for g in engine.groups) * 4
    middle = model.model.layers[args.layers // 2]
    found: list[dict] = []
    units: list[dict] = []

    def probe(module, grad_output):
        if found or not graph_ready:
            return
        gc.collect()
        live = storages(int(args.min_fraction * unit))
        named = owners(engine, model)
        coordinator = engine.coordinator
        units.extend(
            {"unit": u.index, "name": u.name, "gathered": u.is_gathered,
             "prefetched": u.index in coordinator._prefetched,
             "pending": any(g._gather_work is not None for g in u.groups)}
            for u in coordinator.units
        )  # fmt: skip
        reducer = engine.reducer
        units.append({
            "prefetch_numel": coordinator.prefetch_numel, "unit_numel": unit // 4,
            "max_inflight": reducer.max_inflight_numel, "bounded": len(reducer._bounded),
            "inflight": [engine.groups.index(g) for g in reducer._inflight],
            "next_launch": reducer._next_launch,
        })  # fmt: skip
        for ptr, info in sorted(live.items(), key=lambda kv: -kv[1]["bytes"]):
            owner = (
                named.get(ptr) or labels.get(ptr) or "not attributed: no engine attribute holds it"
            )
            found.append({**info, "owner": owner, "units": info["bytes"] / unit})

    middle.register_full_backward_pre_hook(probe)
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())
    graph_ready = False
    for step in range(2):
        x = torch.randint(0, args.vocab, (args.batch_size, args.seq_len), generator=gen)
        loss = engine(input_ids=x, labels=x).loss
        graph_ready = step == 1
        engine.backward(loss)
        engine.step()
    engine.close()
    dist.destroy_process_group()
    return {
        "rank": dist.get_rank() if dist.is_initialized() else None,
        "unit_bytes": unit,
        "live": found,
        "units": units,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--seq_len", type=int, default=32)
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument("--offload", choices=["none", "cpu", "nvme"], default="nvme")
    p.add_argument("--nvme_path", default="/tmp/hf_zero_probe_nvme")
    p.add_argument("--min_fraction", type=float, default=0.25)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--rank_worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank_worker:
        Path(args.result).write_text(json.dumps(rank_main(args)))
        return 0
    flags = ["--rank_worker"] + [
        a for k, v in vars(args).items() if k not in ("rank_worker", "result", "out")
        for a in (f"--{k}", str(v))
    ]  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = launch_ranks(__file__, 2, flags, out / "probe_live_tensors", "probe", 1200)
    for rank, r in enumerate(results):
        print(f"\nrank {rank}: unit = {r['unit_bytes'] / 2**20:.1f} MiB (fp32)")
        print("| MiB | units | dtype | shape | held by |\n|---:|---:|---|---|---|")
        for t in r["live"]:
            print(f"| {t['bytes'] / 2**20:.1f} | {t['units']:.2f} | {t['dtype']} | "
                  f"{t['shape']} | {t['owner']} |")  # fmt: skip
        print("units:", r["units"])
    (out / "probe_live_tensors.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
