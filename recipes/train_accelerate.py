"""A custom training loop with `ZeroAccelerator`: Accelerate's API, hf_zero's engine.

    accelerate launch --config_file configs/accelerate/cpu_2proc.yaml \\
        recipes/train_accelerate.py --zero_stage 3 --output_dir outputs/accelerate

Gradient accumulation through ``accelerator.accumulate``, clipping (the returned norm is the
pre-clip norm), a scheduler, ``gather_for_metrics``, and ``save_state``/``load_state``
(``--resume_from``) all work as in plain Accelerate.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from recipe_utils import check_model_source, load_model_and_tokenizer, make_lm_dataset
from torch.utils.data import DataLoader
from transformers import default_data_collator

from hf_zero import ZeroAccelerator, ZeroPlugin
from hf_zero.config.settings import add_flags, merge_spellings
from hf_zero.launch_errors import parse_or_exit


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_flags(parser, ("stage", "offload_optimizer"))  # --zero_stage, --zero_config, ...
    parser.add_argument("--model_name_or_path", default=None)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max_grad_norm", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output_dir", default="outputs/accelerate")
    parser.add_argument("--save_state_at", type=int, default=None, help="save_state at this step")
    parser.add_argument("--resume_from", default=None, help="a save_state directory")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_or_exit(parse_args, argv)
    parse_or_exit(check_model_source, args.model_name_or_path)
    plugin = parse_or_exit(ZeroPlugin, args.zero_config, **merge_spellings(vars(args))[0])
    accelerator = ZeroAccelerator(
        zero_plugin=plugin, gradient_accumulation_steps=args.gradient_accumulation_steps
    )
    torch.manual_seed(args.seed)
    model, tokenizer = load_model_and_tokenizer(args.model_name_or_path, seed=args.seed)
    with accelerator.main_process_first():
        dataset = make_lm_dataset(tokenizer, 64)
    loader = DataLoader(
        dataset, batch_size=args.batch_size, shuffle=True, collate_fn=default_data_collator
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    # A prepared scheduler steps once per process at each optimizer step (Accelerate's
    # convention, as in transformers' run_clm_no_trainer): count the schedule in those steps.
    total = args.steps * accelerator.num_processes
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * min(s / total, 1.0)))
    )
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    step = 0
    if args.resume_from:
        accelerator.load_state(args.resume_from)
        step = json.loads((Path(args.resume_from) / "step.json").read_text())["step"]
    history = []
    model.train()
    while step < args.steps:
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            step += 1
            mean_loss = accelerator.gather_for_metrics(loss.detach().reshape(1)).mean().item()
            history.append(
                {
                    "step": step,
                    "loss": mean_loss,
                    "grad_norm_pre_clip": norm.item(),
                    "lr_after_step": scheduler.get_last_lr()[0],
                }
            )
            if step % 10 == 0:
                accelerator.print(f"step {step:4d}  loss {mean_loss:.4f}  grad_norm {norm:.3f}")
            if step == args.save_state_at:
                out = Path(args.output_dir) / f"state-{step}"
                accelerator.save_state(str(out))
                if accelerator.is_main_process:
                    (out / "step.json").write_text(json.dumps({"step": step}))
            if step >= args.steps:
                break
    if accelerator.is_main_process:
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.output_dir) / "history.json").write_text(json.dumps(history, indent=1))
    accelerator.end_training()


if __name__ == "__main__":
    main()
