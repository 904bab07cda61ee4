"""QLoRA on hf_zero: per-rank memory and loss of a bitsandbytes base against a 16-bit base.

    python benchmarks/bench_qlora.py [--hidden 512 --layers 4 --steps 100 --out bench_qlora.json]

Each row is one fresh 2-rank gloo group (CPU): a LLaMA-shaped model saved once, loaded with
``from_pretrained`` (bf16, or through ``BitsAndBytesConfig`` as NF4 with bf16 storage or as
LLM.int8), LoRA r 16 on every linear layer, ZeRO stage 2 or 3, ``--steps`` AdamW steps on the
embedded corpus. Reported per rank: `memory_report()`'s bytes of the base (``params`` +
``quantized_params``), the peak RSS of the process, and the mean loss of the last 10 steps, with
its ratio to the bf16 base at the same stage.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import llama_shape

MODES = ("bf16", "nf4", "int8")


def _load(path: str, mode: str):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = None
    if mode == "nf4":
        quant = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=torch.bfloat16,
            bnb_4bit_quant_storage=torch.bfloat16,
        )
    elif mode == "int8":
        quant = BitsAndBytesConfig(load_in_8bit=True)
    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=quant, dtype=torch.bfloat16
    )
    torch.manual_seed(1)
    lora = LoraConfig(r=16, lora_alpha=16, target_modules="all-linear")
    return get_peft_model(model, lora).train()


def _rank(path: str, mode: str, stage: int, steps: int) -> dict:
    import torch.distributed as dist

    import hf_zero
    from hf_zero.tiny import token_batches

    model = _load(path, mode)
    adapters = [p for p in model.parameters() if p.requires_grad]
    engine = hf_zero.initialize(
        model, torch.optim.AdamW(adapters, lr=2e-3), stage=stage, precision="bf16"
    )
    batches = token_batches(64, 4, dist.get_rank(), dist.get_world_size(), seed=0)
    losses = []
    for _ in range(steps):
        x = next(batches)
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
    report = engine.memory_report()
    return {
        "base_bytes": report["params"] + report["quantized_params"],
        "quantized_params": report["quantized_params"],
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "final_loss": sum(losses[-10:]) / 10,
    }


def main(argv=None) -> None:
    from hf_zero.testing import run_distributed
    from hf_zero.tiny import tiny_llama

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--out", default="bench_qlora.json")
    args = parser.parse_args(argv)
    shape = llama_shape(args.hidden, args.layers, 256, 128)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tiny_llama(0, initializer_range=0.3, **shape).save_pretrained(tmp)
        for stage in (2, 3):
            for mode in MODES:
                ranks = run_distributed(_rank, 2, args=(tmp, mode, stage, args.steps), timeout=1800)
                rows.append({"stage": stage, "base": mode, **ranks[0]})
    print(f"hidden {args.hidden}, {args.layers} layers, 2 ranks, bf16, {args.steps} steps")
    print("| stage | base | base MiB/rank | peak RSS MiB | final loss | vs bf16 base |")
    print("|---|---|---:|---:|---:|---:|")
    for row in rows:
        ref = next(r for r in rows if r["stage"] == row["stage"] and r["base"] == "bf16")
        print(
            f"| {row['stage']} | {row['base']} | {row['base_bytes'] / 2**20:.2f} | "
            f"{row['peak_rss'] / 2**20:.0f} | {row['final_loss']:.4f} | "
            f"{row['final_loss'] / ref['final_loss']:.3f}x |"
        )
    Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
