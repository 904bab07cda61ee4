"""Train a causal language model with a custom Accelerate loop, in the style of transformers'
``examples/pytorch/language-modeling/run_clm_no_trainer.py`` (much shorter).

    accelerate launch run_clm_no_trainer.py --output_dir out

Offline by default: the tiny Llama of ``tiny_assets`` on an embedded text in blocks of
``--block_size`` characters; ``--model_name_or_path`` trains a real model. ``Accelerator``,
``prepare``, ``accumulate``, a scheduler from ``get_scheduler``, evaluation through
``gather_for_metrics``, then ``save_pretrained`` and ``all_results.json`` (perplexity).
"""

import argparse
import json
import math
import os

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from tiny_assets import char_tokenizer, sentences, tiny_causal_lm
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer, default_data_collator, get_scheduler


def parse_args():
    parser = argparse.ArgumentParser(description="Train a causal LM with a custom loop")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--model_name_or_path", default=None, help="default: tiny Llama")
    parser.add_argument("--block_size", type=int, default=64)
    parser.add_argument("--per_device_train_batch_size", type=int, default=4)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=4)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--weight_decay", type=float, default=0.01)
    parser.add_argument("--num_train_epochs", type=int, default=1)
    parser.add_argument("--max_train_steps", type=int, default=None)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--lr_scheduler_type", default="linear")
    parser.add_argument("--num_warmup_steps", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def blocks(tokenizer, size: int) -> list[dict]:
    ids = tokenizer(" ".join(sentences()))["input_ids"]
    rows = [torch.tensor(ids[i : i + size]) for i in range(0, len(ids) - size + 1, size)]
    return [{"input_ids": row, "labels": row} for row in rows]


def main():
    args = parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    set_seed(args.seed)
    if args.model_name_or_path:
        tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
        model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path)
    else:
        tokenizer = char_tokenizer()
        model = tiny_causal_lm(len(tokenizer), seed=args.seed)
    data = blocks(tokenizer, args.block_size)
    cut = len(data) * 9 // 10
    train_dataloader = DataLoader(
        data[:cut],
        shuffle=True,
        collate_fn=default_data_collator,
        batch_size=args.per_device_train_batch_size,
    )
    eval_dataloader = DataLoader(
        data[cut:], collate_fn=default_data_collator, batch_size=args.per_device_eval_batch_size
    )
    no_decay = ["bias", "norm.weight"]
    grouped = [
        {
            "params": [p for n, p in model.named_parameters() if not any(x in n for x in no_decay)],
            "weight_decay": args.weight_decay,
        },
        {
            "params": [p for n, p in model.named_parameters() if any(x in n for x in no_decay)],
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
    epochs = math.ceil(args.max_train_steps / steps_per_epoch)

    completed_steps = 0
    for _ in range(epochs):
        model.train()
        for batch in train_dataloader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
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
    eval_loss = torch.mean(torch.cat(losses)).item()
    perplexity = math.exp(eval_loss)
    accelerator.print(f"perplexity: {perplexity} eval_loss: {eval_loss}")

    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(
        args.output_dir, is_main_process=accelerator.is_main_process, save_function=accelerator.save
    )
    if accelerator.is_main_process:
        tokenizer.save_pretrained(args.output_dir)
        with open(os.path.join(args.output_dir, "all_results.json"), "w") as f:
            json.dump({"perplexity": perplexity, "eval_loss": eval_loss}, f)


if __name__ == "__main__":
    main()
