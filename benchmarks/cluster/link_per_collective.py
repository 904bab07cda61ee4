"""Bytes each collective algorithm puts on the link between two nodes, per byte of buffer.

Run in both namespaces by ``bench_cluster.py --per_collective`` (torchrun, 2 nodes x 2 ranks).
For each algorithm: barrier, rank 0 of each node reads its end of the link (``/proc/net/dev``),
``--repeats`` calls on a ``--mbytes`` buffer, barrier, read again. Rank 0 writes
``collectives.json``: link bytes / (repeats x M), where M is the buffer (the output of an
all-gather, the input of a reduce-scatter, the tensor of an all-reduce or broadcast).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from simnet import interface_bytes

from hf_zero.comm import Collectives
from hf_zero.comm.topology import Topology


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--link", required=True)
    parser.add_argument("--mbytes", type=float, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    topo = Topology.build()  # nodes from LOCAL_WORLD_SIZE, as the engine sees them
    n = dist.get_world_size()
    numel = int(args.mbytes * 1e6 / 2) // n * n  # bf16
    full = torch.ones(numel, dtype=torch.bfloat16)
    shard = torch.ones(numel // n, dtype=torch.bfloat16)
    flat = type(topo.dp)(topo.dp.pg, topo.dp.ranks, topo.dp.spans_nodes, topo.dp.node_size)
    comm = Collectives()
    gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    cases = {
        "torch gloo all_gather_into_tensor (ring)": lambda: gather_single(full, shard),
        "torch gloo reduce_scatter_tensor": lambda: scatter_single(shard, full),
        "torch gloo all_reduce (ring)": lambda: dist.all_reduce(full),
        "torch gloo broadcast from rank 0 (tree)": lambda: dist.broadcast(full, 0),
        "hf_zero all-gather, flat exchange": lambda: comm.all_gather(full, shard, flat),
        "hf_zero reduce-scatter, flat exchange": lambda: comm.reduce_scatter(shard, full, flat),
        "hf_zero all-gather, two hops": lambda: comm.all_gather(full, shard, topo.dp),
        "hf_zero reduce-scatter, two hops": lambda: comm.reduce_scatter(shard, full, topo.dp),
    }
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    factors = {}
    for name, call in cases.items():
        call()  # connections made, buffers warm
        dist.barrier()
        before = interface_bytes(args.link) if local_rank == 0 else 0
        dist.barrier()  # nobody sends before both nodes have read their counters
        for _ in range(args.repeats):
            call()
        dist.barrier()
        moved = torch.tensor([interface_bytes(args.link) - before if local_rank == 0 else 0])
        dist.all_reduce(moved)  # both ends count every byte: halve the sum of the two
        factors[name] = moved.item() / 2 / (args.repeats * full.numel() * 2)
    if dist.get_rank() == 0:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "collectives.json").write_text(json.dumps(factors, indent=2))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
