"""Train the embedded tiny Llama on the embedded corpus with ZeRO, offline, on CPU or GPU.

    torchrun --standalone --nproc_per_node 2 recipes/train_tiny.py --zero_stage 2

A plain training loop over `hf_zero.initialize`: the smallest complete example of the engine.
Any ZeRO setting can come from ``--zero_config`` (hf_zero YAML or a DeepSpeed JSON) or
``$HF_ZERO_CONFIG``; a flag below that contradicts the file is an error naming both.
"""

from __future__ import annotations

import argparse
import logging
import math
import time

import torch
import torch.distributed as dist

import hf_zero
from hf_zero.config import AUTO
from hf_zero.config.settings import add_flags, merge_spellings
from hf_zero.config.sources import explicit_values, resolve_sources
from hf_zero.launch_errors import parse_or_exit
from hf_zero.tiny import tiny_llama, token_batches

logger = logging.getLogger("train_tiny")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_flags(parser, ("stage", "offload_optimizer"))  # --zero_stage (default 2), ...
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default=None)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--micro_batch_size", type=int, default=8)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=None)
    parser.add_argument("--seq_len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--max_grad_norm", type=float, default=None, help="default: the file's, else 1.0"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log_every", type=int, default=25)
    parser.add_argument("--output_dir", default=None, help="save the trained model here")
    args = parser.parse_args(argv)
    args.zero, args.given_as = merge_spellings(vars(args))
    if "stage" not in args.zero and args.zero_config is None:
        args.zero["stage"] = 2
    return args


def main(argv=None) -> float:
    args = parse_or_exit(parse_args, argv)
    flags = {
        **args.zero,
        "precision": args.precision,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "gradient_clipping": args.max_grad_norm,
    }
    names = {**args.given_as, "gradient_clipping": "max_grad_norm"}
    config = parse_or_exit(  # mistakes: one line, before any process-group work
        resolve_sources, flags, args.zero_config, flag_names={k: names.get(k, k) for k in flags}
    )
    from_file = explicit_values(args.zero_config).get("gradient_clipping", AUTO)
    if args.max_grad_norm is None and from_file == AUTO:  # the file's value, else 1.0
        config = config.replace(gradient_clipping=1.0)
    hf_zero.init_distributed()
    rank = dist.get_rank()
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"[rank{rank}] %(message)s",
    )
    model = tiny_llama(seed=args.seed)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * min(step / args.steps, 1.0)))
    )
    engine = hf_zero.initialize(model, optimizer, config, lr_scheduler=scheduler)
    gas = engine.config.gradient_accumulation_steps
    world = dist.get_world_size()
    logger.info(
        "ZeRO stage %d%s, %s, %d ranks, %d parameters, micro-batch %d x accumulation %d",
        engine.config.stage,
        " + CPU offload" if engine.config.offload_optimizer == "cpu" else "",
        engine.config.precision,
        world,
        sum(p.numel() for p in model.parameters()),
        args.micro_batch_size,
        gas,
    )

    batches = token_batches(args.seq_len, args.micro_batch_size, rank, world, seed=args.seed)
    model.train()
    start, first_loss, window = time.time(), None, []
    while engine.global_steps + engine.skipped_steps < args.steps:
        tokens = next(batches).to(engine.device)
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        window.append(loss.item())
        if engine.is_gradient_accumulation_boundary():
            engine.step()
            step = engine.global_steps
            mean = torch.tensor(sum(window) / len(window), device=engine.device)
            dist.all_reduce(mean)
            mean = mean.item() / world
            window.clear()
            first_loss = mean if first_loss is None else first_loss
            if step % args.log_every == 0 or step == 1:
                logger.info(
                    "step %4d  loss %.4f  grad_norm(pre-clip) %.3f  lr %.2e  %.1f steps/s",
                    step,
                    mean,
                    engine.grad_norm or 0.0,
                    scheduler.get_last_lr()[0],
                    step / (time.time() - start),
                )
    report = engine.memory_report()
    logger.info("loss %.4f -> %.4f over %d steps", first_loss, mean, engine.global_steps)
    logger.info("memory per rank (bytes): %s", report)
    logger.info("communication: %s", engine.comm_stats)

    state = engine.full_state_dict()
    if args.output_dir and rank == 0:
        model.save_pretrained(args.output_dir, state_dict=state)
        logger.info("saved to %s", args.output_dir)
    dist.barrier()
    dist.destroy_process_group()
    return mean


if __name__ == "__main__":
    main()
