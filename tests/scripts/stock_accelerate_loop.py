"""A custom Accelerate loop in the style of transformers' ``run_clm_no_trainer.py``.

No hf_zero import, no device settings: ``Accelerator(gradient_accumulation_steps=...)``,
``accelerator.prepare``, ``accelerator.accumulate``, ``get_scheduler`` scaled by the process
count, evaluation through ``gather_for_metrics``, then ``save_pretrained`` of the unwrapped model.
Writes OUTPUT_DIR/results_rank<R>.json with the eval loss and perplexity, the per-step losses and
the Accelerator class and process count it saw.
"""

import argparse
import json
import math
import os

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM, default_data_collator, get_scheduler


def parse_args():
    parser = argparse.ArgumentParser(description="Train a causal LM with a custom loop")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--per_device_train_batch_size", type=int, default=4)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=4)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--weight_decay", type=float, default=0.01)
    parser.add_argument("--num_train_epochs", type=int, default=2)
    parser.add_argument("--max_train_steps", type=int, default=None)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--lr_scheduler_type", default="linear")
    parser.add_argument("--num_warmup_steps", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def main():
    args = parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    set_seed(args.seed)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config)
    ids = torch.randint(2, 96, (48, 16), generator=torch.Generator().manual_seed(1))
    train = [{"input_ids": row, "labels": row} for row in ids[:32]]
    evaluation = [{"input_ids": row, "labels": row} for row in ids[32:]]
    train_dataloader = DataLoader(
        train,
        shuffle=True,
        collate_fn=default_data_collator,
        batch_size=args.per_device_train_batch_size,
    )
    eval_dataloader = DataLoader(
        evaluation, collate_fn=default_data_collator, batch_size=args.per_device_eval_batch_size
    )
    no_decay = ["bias", "layer_norm.weight"]
    grouped = [
        {
            "params": [
                p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)
            ],
            "weight_decay": args.weight_decay,
        },
        {
            "params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
            "weight_decay": 0.0,
        },
    ]
    optimizer = torch.optim.AdamW(grouped, lr=args.learning_rate)
    steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    if args.max_train_steps is None:
        args.max_train_steps = args.num_train_epochs * steps_per_epoch
    lr_scheduler = get_scheduler(
        name=args.lr_scheduler_type,
        optimizer=optimizer,
        num_warmup_steps=args.num_warmup_steps * accelerator.num_processes,
        num_training_steps=args.max_train_steps * accelerator.num_processes,
    )
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    args.num_train_epochs = math.ceil(args.max_train_steps / steps_per_epoch)

    completed_steps, step_losses = 0, []
    for _ in range(args.num_train_epochs):
        model.train()
        for batch in train_dataloader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                step_losses.append(accelerator.gather(loss.detach()).mean().item())
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                completed_steps += 1
            if completed_steps >= args.max_train_steps:
                break

    model.eval()
    losses = []
    for batch in eval_dataloader:
        with torch.no_grad():
            loss = model(**batch).loss
        losses.append(accelerator.gather_for_metrics(loss.repeat(args.per_device_eval_batch_size)))
    eval_loss = torch.mean(torch.cat(losses))
    perplexity = math.exp(eval_loss)
    accelerator.print(f"perplexity: {perplexity} eval_loss: {eval_loss}")

    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(
        args.output_dir, is_main_process=accelerator.is_main_process, save_function=accelerator.save
    )
    results = {
        "perplexity": perplexity,
        "eval_loss": eval_loss.item(),
        "step_losses": step_losses,
        "accelerator": type(accelerator).__name__,
        "num_processes": accelerator.num_processes,
    }
    rank = accelerator.process_index
    with open(os.path.join(args.output_dir, f"results_rank{rank}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
