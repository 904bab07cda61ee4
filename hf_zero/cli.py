"""The ``hf-zero`` command.

hf-zero config FILE        validate an hf_zero YAML/JSON or DeepSpeed JSON, print the result
hf-zero env                versions and devices, for bug reports
hf-zero --version
"""

from __future__ import annotations

import argparse
import platform
import sys

import yaml


def _cmd_config(args: argparse.Namespace) -> int:
    from hf_zero.config import ZeroConfig

    overrides = {}
    for item in args.set or []:
        key, _, value = item.partition("=")
        overrides[key] = yaml.safe_load(value)
    try:
        config = ZeroConfig.load(args.path, **overrides)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(yaml.safe_dump(config.to_dict(), sort_keys=False), end="")
    return 0


def _cmd_consolidate(args: argparse.Namespace) -> int:
    import torch

    from hf_zero.consolidate import consolidate

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    try:
        files = consolidate(
            args.checkpoint,
            args.output,
            dtype=dtype,
            adapter_only=args.adapter_only,
            max_shard_bytes=int(args.max_shard_size_gb * 2**30),
        )
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for path in files:
        print(path)
    return 0


def _count_params(args: argparse.Namespace) -> int:
    if args.params is not None:
        return int(float(args.params))
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(args.model_config)
    with torch.device("meta"):  # shapes only: nothing is allocated
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def _cmd_estimate(args: argparse.Namespace) -> int:
    from hf_zero.memory import model_state_bytes

    if (args.params is None) == (args.model_config is None):
        print("error: give exactly one of --params or --model-config", file=sys.stderr)
        return 2
    params = _count_params(args)
    gib = 2**30
    print(f"{params:,} parameters, {args.dp} data-parallel ranks, {args.precision}, Adam")
    print(f"{'stage':>5} {'offload':>8} {'device GiB':>11} {'host GiB':>9}")
    for stage in (0, 1, 2, 3):
        for offload in (False, True):
            if offload and stage == 0:
                continue
            m = model_state_bytes(params, args.dp, stage, args.precision, offload)
            print(
                f"{stage:>5} {offload!s:>8} {m['total'] / gib:>11.2f} {m['host_total'] / gib:>9.2f}"
            )
    print("model states only (parameters, gradients, master weights, Adam); add activations")
    return 0


def _cmd_env(args: argparse.Namespace) -> int:
    import accelerate
    import torch
    import transformers

    import hf_zero

    rows = {
        "hf_zero": hf_zero.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "cuda available": torch.cuda.is_available(),
        "cuda devices": torch.cuda.device_count(),
        "gloo available": torch.distributed.is_gloo_available(),
        "nccl available": torch.distributed.is_nccl_available(),
    }
    for key, value in rows.items():
        print(f"{key:>16}: {value}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from hf_zero import __version__

    parser = argparse.ArgumentParser(prog="hf-zero", description="hf_zero command-line tools")
    parser.add_argument("--version", action="version", version=f"hf_zero {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("config", help="validate a config file and print the resolved settings")
    p.add_argument("path", help="hf_zero YAML/JSON or DeepSpeed JSON")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a field")
    p.set_defaults(func=_cmd_config)
    p = sub.add_parser(
        "consolidate", help="sharded engine checkpoint -> Hugging Face safetensors (streamed)"
    )
    p.add_argument("checkpoint", help="a directory written by engine.save_checkpoint")
    p.add_argument("output", help="directory for model.safetensors (or adapter_model.safetensors)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.add_argument("--adapter-only", action="store_true", help="LoRA weights, PEFT key names")
    p.add_argument("--max-shard-size-gb", type=float, default=5.0)
    p.set_defaults(func=_cmd_consolidate)
    p = sub.add_parser("estimate", help="per-rank model-state memory of each ZeRO stage")
    p.add_argument("--params", help="parameter count, e.g. 7e9")
    p.add_argument("--model-config", help="a local model directory or config.json")
    p.add_argument("--dp", type=int, default=1, help="data-parallel ranks")
    p.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.set_defaults(func=_cmd_estimate)
    p = sub.add_parser("env", help="print versions and devices")
    p.set_defaults(func=_cmd_env)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
