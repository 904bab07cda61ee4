"""A plain transformers training script: no hf_zero import anywhere.

    python stock_trainer.py --output_dir DIR [--subclass | --trl]

Writes DIR/report_rank<R>.json: the Trainer class's MRO, whether hf_zero was imported, the
element count of each parameter as the model exposes it mid-training, and the final logits of a
fixed probe (every rank computes them).
"""

import argparse
import json
import os
import sys

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, **{chr(c): c - 30 for c in range(32, 127)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


class Report(TrainerCallback):
    sizes = {}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == 2:
            Report.sizes = {n: p.numel() for n, p in model.named_parameters()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--subclass", action="store_true")
    parser.add_argument("--trl", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config)
    common = dict(
        output_dir=args.output_dir,
        max_steps=6,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        report_to="none",
        save_strategy="no",
        logging_steps=2,
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
    )
    ids = torch.randint(2, 96, (32, 16), generator=torch.Generator().manual_seed(1))
    if args.trl:
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        text = ["".join(chr(int(i) + 30) for i in row) for row in ids]
        trainer = SFTTrainer(
            model=model,
            args=SFTConfig(**common, max_length=32, dataset_text_field="text"),
            train_dataset=Dataset.from_dict({"text": text}),
            processing_class=tokenizer(),
            callbacks=[Report()],
        )
    else:
        cls = Trainer
        if args.subclass:

            class MyTrainer(Trainer):
                def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
                    return super().compute_loss(model, inputs, return_outputs, **kwargs)

            cls = MyTrainer
        data = [{"input_ids": row, "labels": row} for row in ids]
        trainer = cls(model=model, args=TrainingArguments(**common), train_dataset=data)
        trainer.add_callback(Report())
    trainer.train()
    trainer.save_model(args.output_dir)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids[:2].to(trainer.args.device)).logits.float().cpu()
    rank = int(os.environ.get("RANK", 0))
    report = {
        "mro": [c.__name__ for c in type(trainer).__mro__],
        "hf_zero_imported": "hf_zero" in sys.modules,
        "sizes": Report.sizes,
        "logits": logits.tolist(),
    }
    with open(os.path.join(args.output_dir, f"report_rank{rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
