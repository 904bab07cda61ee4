"""Train a causal language model with the `Trainer`, in the style of transformers'
``examples/pytorch/language-modeling/run_clm.py`` (much shorter).

    python run_clm.py --output_dir out --do_train --do_eval

Offline by default: the tiny Llama of ``tiny_assets`` on an embedded text, cut into blocks of
``--block_size`` characters. ``--model_name_or_path`` and ``--dataset_name`` (a dataset with a
``text`` column) train a real model on real data instead. Writes the model, the tokenizer,
``trainer_state.json`` and ``*_results.json``, as the transformers example does.
"""

import math
from dataclasses import dataclass, field

from datasets import Dataset, load_dataset
from tiny_assets import char_tokenizer, sentences, tiny_causal_lm
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    default_data_collator,
)


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(default=None, metadata={"help": "default: tiny Llama"})
    dataset_name: str | None = field(default=None, metadata={"help": "default: embedded text"})
    block_size: int = 64


def main():
    parser = HfArgumentParser((ModelArguments, TrainingArguments))
    model_args, training_args = parser.parse_args_into_dataclasses()
    if model_args.model_name_or_path:
        tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
        model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path)
    else:
        tokenizer = char_tokenizer()
        model = tiny_causal_lm(len(tokenizer), seed=training_args.seed)
    if model_args.dataset_name:
        raw = load_dataset(model_args.dataset_name, split="train")
    else:
        raw = Dataset.from_dict({"text": [" ".join(sentences())]})

    def group_texts(batch):
        ids = [i for row in tokenizer(batch["text"])["input_ids"] for i in row]
        size = model_args.block_size
        blocks = [ids[i : i + size] for i in range(0, len(ids) - size + 1, size)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

    with training_args.main_process_first(desc="grouping texts"):
        data = raw.map(group_texts, batched=True, remove_columns=raw.column_names)
    splits = data.train_test_split(test_size=0.1, seed=0)
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=splits["train"],
        eval_dataset=splits["test"],
        processing_class=tokenizer,
        data_collator=default_data_collator,
    )
    if training_args.do_train:
        result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model()
        trainer.log_metrics("train", result.metrics)
        trainer.save_metrics("train", result.metrics)
        trainer.save_state()
    if training_args.do_eval:
        metrics = trainer.evaluate()
        metrics["perplexity"] = math.exp(metrics["eval_loss"])
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)


if __name__ == "__main__":
    main()
