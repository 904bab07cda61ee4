"""The ``hf-zero`` command.

hf-zero config FILE        validate an hf_zero YAML/JSON or DeepSpeed JSON, print the result
hf-zero estimate ...       per-rank memory per stage (model states, working set, activations)
hf-zero run SCRIPT ...     an unmodified Trainer script with hf_zero (see hf_zero.run)
hf-zero autoload on|off    let HF_ZERO_CONFIG alone activate hf_zero (a .pth hook)
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
    from hf_zero.config.settings import SETTINGS, flags_markdown

    if args.flags:
        print(flags_markdown(), end="")
        return 0
    if args.path is None:
        print("error: hf-zero config needs a config file (or --flags)", file=sys.stderr)
        return 2
    overrides = {}
    for item in args.set or []:
        key, _, value = item.partition("=")
        overrides[key] = yaml.safe_load(value)
    try:
        config = ZeroConfig.load(args.path).replace(**overrides)  # --set: what-if, it wins
    except (ValueError, NotImplementedError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    # Each key a flag can set says which (the settings table, `hf_zero.config.settings`).
    flag_of = {s.key: s.flag for s in SETTINGS}
    for line in yaml.safe_dump(config.to_dict(), sort_keys=False).splitlines():
        key = line.split(":", 1)[0]
        print(f"{line}  # --{flag_of[key]}" if key in flag_of else line)
    return 0


def _cmd_consolidate(args: argparse.Namespace) -> int:

    from hf_zero.checkpoint.consolidate import consolidate
    from hf_zero.numerics.precision import DTYPES

    dtype = DTYPES[args.dtype]
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


# Well-known shapes for `hf-zero estimate --model NAME` (no download): transformers config fields.
MODEL_PRESETS = {
    "llama-2-7b": dict(
        model_type="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
    ),
    "llama-2-13b": dict(
        model_type="llama", hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
        num_attention_heads=40, num_key_value_heads=40, vocab_size=32000,
    ),
    "llama-3-8b": dict(
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
    ),
    "llama-3-70b": dict(
        model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
    ),
    "mistral-7b": dict(
        model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
    ),
    "qwen3-8b": dict(
        model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
    ),
}  # fmt: skip


def _model_shape(args: argparse.Namespace):
    """A `ModelShape` from --params, --model-config (a local directory) or --model (a preset)."""
    from hf_zero.memory import ModelShape, shape_of

    if args.params is not None:
        return ModelShape(params=int(float(args.params)))
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if args.model is not None:
        if args.model not in MODEL_PRESETS:
            raise ValueError(f"--model {args.model!r}; known: {', '.join(MODEL_PRESETS)}")
        values = dict(MODEL_PRESETS[args.model])
        config = AutoConfig.for_model(values.pop("model_type"), **values)
    else:
        try:
            config = AutoConfig.from_pretrained(args.model_config)
        except OSError as err:  # not a directory or config.json: say so in one line
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise ValueError(f"--model-config {args.model_config!r}: {first}") from None
    with torch.device("meta"):  # shapes only: nothing is allocated
        return shape_of(AutoModelForCausalLM.from_config(config))


def _positive(text: str) -> int:
    """An argparse type: a whole number of at least 1 (a rank count, a size)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not allowed: at least 1")
    return value


def _cmd_estimate(args: argparse.Namespace) -> int:
    from hf_zero.memory import (
        PAPER_FORMULA,
        WHY_NOT_PAPER,
        activation_bytes,
        estimate,
        formula,
        working_set_bytes,
    )

    given = [a for a in (args.params, args.model_config, args.model) if a is not None]
    if len(given) != 1:
        print("error: give exactly one of --params, --model-config or --model", file=sys.stderr)
        return 2
    try:
        shape = _model_shape(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.pp > 1:
        return _estimate_pipeline(args, shape)
    frozen = 0
    if args.trainable_params is not None:
        frozen = shape.params - int(float(args.trainable_params))
    gib = 2**30
    gas = args.gradient_accumulation_steps
    if args.dp % args.hpz:
        print(f"error: --hpz {args.hpz} must divide --dp {args.dp}", file=sys.stderr)
        return 2
    split = f" ({shape.tp_split_params:,} split by AutoTP)" if args.tp > 1 else ""
    print(
        f"{shape.params:,} parameters{split}, "
        f"{args.dp} data-parallel x {args.tp} tensor-parallel ranks, {args.precision}, Adam"
        + (f", {frozen:,} frozen" + _frozen_format(args.mixz) if frozen else "")
        + (f", hpZ {args.hpz}" if args.hpz > 1 else "")
        + (f", {gas} micro-batches per step" if gas > 1 else "")
    )
    print(
        f"{'stage':>5} {'offload':>9} {'device GiB':>11} {'host GiB':>9} {'+ working set':>14} "
        f"{'hf_zero':>12} {'ZeRO paper':>11}"
    )
    # (stage, offload_optimizer, offload_param, 16-bit storage): then ZeRO-Infinity's CPU tier;
    # bf16 runs add the rows with bf16 master weights and optimizer state, on the device and
    # offloaded ("cpu+bf16")
    rows = [(0, False, False, False)]
    rows += [(s, o, False, False) for s in (1, 2, 3) for o in (False, True)]
    rows += [(3, True, True, False)]
    if args.precision == "bf16":
        rows += [(s, False, False, True) for s in (1, 2, 3)]
        rows += [(s, True, False, True) for s in (1, 2, 3)]
    for stage, offload, offload_param, compact in rows:
        m = estimate(
            shape, args.dp, stage, args.precision, offload, args.tp, args.hpz, frozen,
            args.mixz, gradient_accumulation_steps=gas, offload_param=offload_param,
            storage_16bit=compact,
        )  # fmt: skip
        work = working_set_bytes(shape, stage, args.precision, args.tp)
        label = "opt+param" if offload_param else str(offload)
        label = ("cpu+bf16" if offload else "bf16 opt") if compact else label
        hf = formula(stage, args.precision, offload, gas, offload_param, compact)
        # Stage 3's working set needs the layer sizes (--model / --model-config).
        known = stage < 3 or shape.largest_unit_params
        work_text = f"{work / gib:>14.2f}" if known else f"{'unknown':>14}"
        print(
            f"{stage:>5} {label:>9} {m['total'] / gib:>11.2f} "
            f"{m['host_total'] / gib:>9.2f} {work_text} "
            f"{hf:>12} {PAPER_FORMULA[stage]:>11}"
        )
    _print_infinity_rows(args, shape)
    if shape.hidden:
        for ckpt in (False, True):
            act = activation_bytes(
                shape, args.seq_len, args.micro_batch, args.precision, ckpt, args.tp
            )
            label = "with" if ckpt else "without"
            print(
                f"activations {label} checkpointing (sequence {args.seq_len}, micro-batch "
                f"{args.micro_batch}): {act / gib:.2f} GiB"
            )
        if shape.vocab:
            _print_sequence_rows(args, shape)
    print(
        "GiB = 2^30 bytes (1 GiB = 1.074 GB). Model states: parameters, gradients, fp32 master "
        "weights, Adam, on the device (hf_zero column: P parameters, N data-parallel ranks); "
        "working set: stage 3's gathered layers."
    )
    print(WHY_NOT_PAPER)
    return 0


def _print_sequence_rows(args: argparse.Namespace, shape) -> None:
    """Per-rank activations and logits at ``--seq-len``, with and without tiling and SP."""
    from hf_zero.memory import sequence_bytes

    gib = 2**30
    print(
        f"{'per rank, sequence ' + str(args.seq_len):>34} {'activations GiB':>16} {'logits GiB':>11}"
    )
    sps = sorted({1, args.sp})
    for sp in sps:
        for ckpt in (False, True):
            for tiled in (False, True):
                m = sequence_bytes(
                    shape, args.seq_len, args.micro_batch, args.precision, sp, ckpt, tiled
                )
                label = (
                    f"sp {sp}"
                    + (" + checkpointing" if ckpt else "")
                    + (" + tiled" if tiled else "")
                )
                print(f"{label:>34} {m['activations'] / gib:>16.2f} {m['logits'] / gib:>11.2f}")


def _print_infinity_rows(args: argparse.Namespace, shape) -> None:
    """Stage 3 with NVMe tiers: what stays in memory, the I/O buffers, the swap files."""
    from hf_zero.memory import infinity_bytes

    if not shape.largest_unit_params:
        print("ZeRO-Infinity (NVMe) rows need the layer sizes: --model or --model-config")
        return
    gib = 2**30
    head = f"{'stage 3 NVMe':>15} {'device GiB':>11} {'host GiB':>13} {'+ working set':>14}"
    print(f"{head} {'disk GiB':>9}")
    rows = [("optimizer", False, 0, 0, 0), ("opt+param", True, 0, 0, 0)]
    cached, held = int(args.max_in_cpu), int(args.optimizer_max_in_cpu)
    if cached or held:
        rows.append(("+ cached", True, cached, held, 0))
    if args.precision == "bf16":  # optimizer_states_dtype, then master_weights_dtype too: bf16
        rows += [("+ bf16 state", True, cached, held, 1), ("+ bf16 master", True, cached, held, 2)]
    for label, offload_param, cached, held, in_16bit in rows:
        prefetch = int(0.9 * shape.hidden**2)  # stage3_prefetch_bucket_size: auto
        m = infinity_bytes(
            shape, args.dp, args.precision, offload_param, prefetch_bucket_size=prefetch,
            param_cache_numel=cached, optimizer_cache_numel=held,
            optimizer_states_16bit=in_16bit >= 1, master_weights_16bit=in_16bit == 2,
        )  # fmt: skip
        print(
            f"{label:>15} {m['params'] / gib:>11.2f} {m['host_io_buffers'] / gib:>13.2f} "
            f"{m['working_set'] / gib:>14.2f} {m['nvme_total'] / gib:>9.2f}"
        )
    _print_memory_first_defaults(args, shape)


def _print_memory_first_defaults(args: argparse.Namespace, shape) -> None:
    """The sizes a config that names none gets under NVMe or parameter offload (as the rows
    above assume), read from `ZeroConfig.resolved`."""
    from hf_zero.config import ZeroConfig
    from hf_zero.memory import BYTES

    config = ZeroConfig(stage=3, offload_param="cpu").resolved(hidden_size=shape.hidden)
    b, mib = BYTES[args.precision], 2**20
    print(
        "defaults when a tier is on NVMe or parameters are offloaded (any size you set is kept): "
        f"prefetch {config.prefetch_bucket_size:,} elements (one unit ahead), reductions in "
        f"flight {config.reduce_inflight_numel:,} elements ({b * config.reduce_inflight_numel / mib:.0f}"
        f" MiB; at least one unit's), read-ahead {config.offload_param_buffer_count} unit shards, "
        f"{config.offload_optimizer_buffer_count} optimizer tile sets"
    )


def _estimate_pipeline(args: argparse.Namespace, shape) -> int:
    """``--pp N``: the largest stage's model states (ZeRO 0-2 over ``--dp`` replicas), its
    activations per schedule (micro-batches in flight) and each schedule's bubble."""
    import dataclasses

    from hf_zero.memory import activation_bytes, estimate
    from hf_zero.pipeline.schedule_math import bubble_fraction, in_flight, largest_stage_params

    if not shape.layers or not shape.largest_unit_params:
        print(
            "error: --pp needs the model's layers: give --model or --model-config", file=sys.stderr
        )
        return 2
    pp, layer = args.pp, shape.largest_unit_params
    m = args.gradient_accumulation_steps if args.gradient_accumulation_steps > 1 else pp
    embed = shape.embedding_params or max(0, (shape.params - shape.layers * layer) // 2)
    stage_params = largest_stage_params(layer, shape.layers, embed, pp)
    fraction = stage_params / shape.params
    stage = dataclasses.replace(
        shape, params=stage_params, tp_split_params=int(shape.tp_split_params * fraction),
        layers=-(-shape.layers // pp),
    )  # fmt: skip
    gib = 2**30
    print(
        f"{shape.params:,} parameters in {pp} pipeline stages (largest {stage_params:,}, "
        f"{stage.layers} layers) x {args.dp} data-parallel x {args.tp} tensor-parallel ranks, "
        f"{args.precision}, Adam, {m} micro-batches of {args.micro_batch} x {args.seq_len}"
    )
    compact = args.precision == "bf16"  # bf16 runs may keep master weights and Adam in bf16
    print(
        f"{'stage':>5} {'device GiB (largest pipeline stage)':>36} "
        f"{'with offload_optimizer cpu: device':>35} {'host GiB':>9}"
        + (f" {'bf16 master+opt: device':>24}" if compact else "")
    )
    for zero in (0, 1, 2):
        kw = dict(tp_size=args.tp, gradient_accumulation_steps=m)
        states = estimate(stage, args.dp, zero, args.precision, **kw)
        offload = ("-", "-")  # offload needs a sharded optimizer (stage 1 or 2)
        if zero:
            moved = estimate(stage, args.dp, zero, args.precision, offload=True, **kw)
            offload = (f"{moved['total'] / gib:.2f}", f"{moved['host_total'] / gib:.2f}")
        line = f"{zero:>5} {states['total'] / gib:>36.2f} {offload[0]:>35} {offload[1]:>9}"
        if compact:
            small = estimate(stage, args.dp, zero, args.precision, storage_16bit=True, **kw)
            line += f" {small['total'] / gib:>24.2f}"
        print(line)
    per_mb = activation_bytes(stage, args.seq_len, args.micro_batch, args.precision, False, args.tp)
    print(f"{'schedule':>17} {'in flight':>9} {'activations GiB':>16} {'bubble':>7}")
    for schedule in ("gpipe", "1f1b", "interleaved_1f1b"):
        held = in_flight(schedule, pp, m)
        print(
            f"{schedule:>17} {held:>9g} {held * per_mb / gib:>16.2f} "
            f"{bubble_fraction(schedule, pp, m):>7.1%}"
        )
    print(
        "First stage (the most micro-batches in flight), no activation checkpointing; the "
        "head counted as large as the embedding (its own weight or a tied copy); ZeRO-3 (and "
        "so parameter or NVMe offload) does not combine with pipeline stages. Bubble: "
        "(p-1)/(m+p-1), interleaved (p-1)/(2m+p-1)."
    )
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from hf_zero.run import main as run_main

    return run_main([args.script, *args.script_args])


def _pth_path(site_dir: str | None):
    import sysconfig
    from pathlib import Path

    from hf_zero._autoload import PTH_NAME

    return Path(site_dir or sysconfig.get_paths()["purelib"]) / PTH_NAME


def _cmd_autoload(args: argparse.Namespace) -> int:
    from hf_zero._autoload import PTH_LINE

    path = _pth_path(args.site_dir)
    if args.action == "on":
        path.write_text(PTH_LINE)
        print(f"wrote {path}: HF_ZERO_CONFIG=FILE now puts hf_zero under every Trainer")
    elif args.action == "off":
        path.unlink(missing_ok=True)
        print(f"removed {path}")
    else:
        print(f"{'on' if path.is_file() else 'off'} ({path})")
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


def _frozen_format(mixz: str | None) -> str:
    if mixz is None:
        return ""
    return " as INT8 (MixZ++)" if mixz == "int8" else f" as a bitsandbytes {mixz.upper()} base"


def main(argv: list[str] | None = None) -> int:
    from hf_zero._version import __version__

    parser = argparse.ArgumentParser(prog="hf-zero", description="hf_zero command-line tools")
    parser.add_argument("--version", action="version", version=f"hf_zero {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("config", help="validate a config file and print the resolved settings")
    p.add_argument("path", nargs="?", help="hf_zero YAML/JSON or DeepSpeed JSON")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a field")
    p.add_argument("--flags", action="store_true", help="list the command-line flags instead")
    p.set_defaults(func=_cmd_config)
    p = sub.add_parser(
        "consolidate", help="sharded engine checkpoint -> Hugging Face safetensors (streamed)"
    )
    p.add_argument(
        "checkpoint", help="engine.save_checkpoint's directory, or a Trainer checkpoint-N"
    )
    p.add_argument("output", help="directory for model.safetensors (or adapter_model.safetensors)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.add_argument(
        "--adapter-only", action="store_true", help="PEFT checkpoints: the adapter, PEFT format"
    )
    p.add_argument("--max-shard-size-gb", type=float, default=5.0)
    p.set_defaults(func=_cmd_consolidate)
    p = sub.add_parser("estimate", help="per-rank memory of each ZeRO stage")
    p.add_argument("--params", help="parameter count, e.g. 7e9")
    p.add_argument("--model-config", help="a local model directory or config.json")
    p.add_argument("--model", help=f"a known shape: {', '.join(MODEL_PRESETS)}")
    p.add_argument("--dp", type=_positive, default=1, help="data-parallel ranks")
    p.add_argument("--tp", type=_positive, default=1, help="tensor-parallel ranks (AutoTP)")
    p.add_argument("--pp", type=_positive, default=1, help="pipeline stages (ZeRO 0-2 inside each)")
    p.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--hpz", type=_positive, default=1, help="ZeRO++ hpZ partition size")
    p.add_argument("--trainable-params", help="LoRA: trainable count; the rest is frozen")
    p.add_argument(
        "--mixz",
        nargs="?",
        const="int8",
        choices=["int8", "nf4", "fp4"],
        help="frozen weights quantized: MixZ++ INT8 shards (stage 3; the default), or NF4/FP4 "
        "(a bitsandbytes 4-bit base at every stage, sharded at stage 3; or MixZ++ nf4/fp4)",
    )
    p.add_argument(
        "--max-in-cpu",
        type=float,
        default=0,
        help="ZeRO-Infinity: parameter elements per rank cached in host memory "
        "(offload_param_max_in_cpu; the NVMe rows add one with them)",
    )
    p.add_argument(
        "--optimizer-max-in-cpu",
        type=float,
        default=0,
        help="ZeRO-Infinity: optimizer elements per rank kept in host memory, 16 bytes each "
        "(offload_optimizer_max_in_cpu; the NVMe rows add one with them)",
    )
    p.add_argument("--seq-len", type=_positive, default=2048)
    p.add_argument("--sp", type=_positive, default=1, help="sequence-parallel ranks (Ulysses)")
    p.add_argument("--micro-batch", type=_positive, default=1)
    p.add_argument(
        "--gradient-accumulation-steps",
        type=int,
        default=1,
        help="micro-batches per step (> 1: stages 2-3 keep an fp32 gradient shard in the "
        "window; with --pp, the pipeline's micro-batches, default --pp)",
    )
    p.set_defaults(func=_cmd_estimate)
    p = sub.add_parser("run", help="run an unmodified Trainer script with hf_zero")
    p.add_argument("script", help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments + hf_zero flags")
    p.set_defaults(func=_cmd_run)
    p = sub.add_parser("autoload", help="let HF_ZERO_CONFIG activate hf_zero in any command")
    p.add_argument("action", choices=["on", "off", "status"])
    p.add_argument("--site-dir", help="site-packages directory (default: this environment's)")
    p.set_defaults(func=_cmd_autoload)
    p = sub.add_parser("env", help="print versions and devices")
    p.set_defaults(func=_cmd_env)
    from hf_zero.doctor.command import add_parser as add_doctor

    add_doctor(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
