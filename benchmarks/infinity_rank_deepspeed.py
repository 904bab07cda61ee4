"""One rank of DeepSpeed's ZeRO-Infinity for `bench_infinity.py`: the same model, batches and
AdamW settings as hf_zero's rows, under DeepSpeed 0.19.8's stage 3 with ``offload_param`` and
``offload_optimizer`` on ``cpu`` or ``nvme``.

    apt-get install libaio-dev          # the headers of DeepSpeed's async_io op (NVMe)
    DS_BUILD_OPS=0 pip install --no-deps --target /work/dslib deepspeed==0.19.8 \\
        einops hjson msgpack ninja py-cpuinfo
    PYTHONPATH=/work/dslib python benchmarks/bench_infinity.py --deepspeed ...

The model is built as transformers builds it for DeepSpeed (``HfDeepSpeedConfig``: inside
``deepspeed.zero.Init``, never whole on a rank, as hf_zero's ``partitioned_init``). Offload buffers are sized to the model, as a careful user would:
``offload_param.buffer_size`` is the largest parameter (DeepSpeed's default of 1e8 elements
would hold 5 x 400 MB of fp32 buffers), the counts are hf_zero's defaults (5 and 4). The
optimizer is DeepSpeed's CPU AdamW (its offload path requires it) with torch's AdamW defaults.
The first run JIT-builds ``async_io`` and ``cpu_adam`` (minutes, cached after that).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))


def run(args) -> dict:
    import deepspeed
    import torch
    import torch.distributed as dist
    from bench_infinity import timed_steps
    from bench_memory import proc_status, reset_peak
    from common import llama_shape
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    from hf_zero.tiny import tiny_llama_config

    device = args.ds_device
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    config = tiny_llama_config(**llama_shape(args.hidden, args.layers, args.vocab, args.seq_len))
    base = proc_status()
    h = args.hidden
    largest = max(args.vocab * h, h * (h * 8 // 3 // 64 * 64))
    zero = {
        "stage": 3,
        "offload_param": {"device": device, "pin_memory": False},
        "offload_optimizer": {"device": device, "pin_memory": False},
        "reduce_bucket_size": h * h,
        "stage3_prefetch_bucket_size": int(0.9 * h * h),
        "stage3_param_persistence_threshold": 10 * h,
        "sub_group_size": int(1e9),
    }
    if device == "nvme":
        zero["offload_param"].update(nvme_path=args.nvme_path, buffer_count=5, buffer_size=largest)
        zero["offload_optimizer"].update(nvme_path=args.nvme_path, buffer_count=4)
    ds_config = {
        "train_micro_batch_size_per_gpu": args.batch_size,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
        },
        "zero_optimization": zero,
        "aio": {
            "block_size": 1 << 20,
            "queue_depth": 8,
            "thread_count": args.io_threads,
            "single_submit": False,
            "overlap_events": True,
        },
        "steps_per_print": 10**9,
    }
    # As the Trainer does: transformers builds under zero.Init and initialises each weight
    # gathered (without this the partitioned weights would keep torch.empty's values).
    keep_alive = HfDeepSpeedConfig(ds_config)  # noqa: F841 (transformers holds a weak reference)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config
    )
    initialized = proc_status()
    reset_peak()
    record, _ = timed_steps(engine, args, rank)  # as hf_zero's rows are timed
    peak = proc_status()
    dist.barrier()
    return {
        "config": f"DeepSpeed {device}/{device}",
        "rank": rank,
        "deepspeed": deepspeed.__version__,
        "base_rss": base["VmRSS"],
        "build_peak": initialized["VmHWM"],
        "peak": max(initialized["VmHWM"], peak["VmHWM"]),
        "peak_steps": peak["VmHWM"],
        **record,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, kind in (("hidden", int), ("layers", int), ("vocab", int), ("seq_len", int),
                       ("batch_size", int), ("steps", int), ("io_threads", int)):  # fmt: skip
        p.add_argument(f"--{name}", type=kind, required=True)
    p.add_argument("--nvme_path", required=True)
    p.add_argument("--ds_device", choices=["cpu", "nvme"], required=True)
    p.add_argument("--result", required=True)
    args, _ = p.parse_known_args(argv)
    Path(args.result).write_text(json.dumps(run(args)))
    sys.stdout.flush()
    sys.stderr.flush()
    # DeepSpeed's async_io handle can abort in its destructor at interpreter exit ("terminate
    # called without an active exception"): the result is written, leave without destructors.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
