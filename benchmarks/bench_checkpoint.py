"""What checkpoint checksums cost: engine save and load with and without them, side by side.

    python benchmarks/bench_checkpoint.py [--hidden 1024 --layers 8 --repeats 3]

One 2-rank gloo group (CPU), a LLaMA-shaped model at stage 2 with AdamW state after one step
(fp32 master + two moments: 12 bytes per parameter, half on each rank). Each repeat saves the
checkpoint with block CRC-32s (what hf_zero writes) and without (``checkpoint_stream.CHECKSUMS``
off), into fresh folders, and loads each back (a file with checksums is verified on every read;
one without is read unverified). Reported: rank 0's median wall time of each, and the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import llama_shape


def _rank(folder: str, shape: dict, repeats: int) -> dict:
    import torch.distributed as dist

    import hf_zero
    from hf_zero.checkpoint import format as checkpoint_format
    from hf_zero.storage import safetensors as checkpoint_stream
    from hf_zero.tiny import tiny_llama, token_batches

    model = tiny_llama(0, **shape)
    engine = hf_zero.initialize(model, torch.optim.AdamW(model.parameters()), stage=2)
    x = next(token_batches(32, 2, dist.get_rank(), dist.get_world_size(), seed=0))
    engine.backward(engine(input_ids=x, labels=x).loss)
    engine.step()
    times: dict[str, list[float]] = {}
    for i in range(repeats):
        for checksums in (True, False):
            label = "with" if checksums else "without"
            checkpoint_stream.CHECKSUMS = checkpoint_format.REQUIRE_CHECKSUMS = checksums
            path = f"{folder}/{label}-{i}"
            dist.barrier()
            start = time.perf_counter()
            engine.save_checkpoint(path)
            times.setdefault(f"save {label}", []).append(time.perf_counter() - start)
            dist.barrier()
            start = time.perf_counter()
            engine.load_checkpoint(path)
            times.setdefault(f"load {label}", []).append(time.perf_counter() - start)
    checkpoint_stream.CHECKSUMS = checkpoint_format.REQUIRE_CHECKSUMS = True
    size = sum(p.stat().st_size for p in Path(f"{folder}/with-0").iterdir())
    return {"median_s": {k: statistics.median(v) for k, v in times.items()}, "bytes": size}


def main(argv=None) -> None:
    from hf_zero.testing import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="bench_checkpoint.json")
    args = parser.parse_args(argv)
    shape = llama_shape(args.hidden, args.layers, 256, 128)
    with tempfile.TemporaryDirectory(dir=".") as folder:
        row = run_distributed(_rank, 2, args=(folder, shape, args.repeats), timeout=3600)[0]
    t = row["median_s"]
    print(f"stage 2, 2 ranks, checkpoint {row['bytes'] / 2**20:.0f} MiB, median of {args.repeats}")
    print("| | with checksums | without | ratio |")
    print("|---|---:|---:|---:|")
    for kind in ("save", "load"):
        a, b = t[f"{kind} with"], t[f"{kind} without"]
        print(f"| {kind} | {a:.2f} s | {b:.2f} s | {a / b:.3f}x |")
    Path(args.out).write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
