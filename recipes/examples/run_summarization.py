"""Fine-tune a sequence-to-sequence model with `Seq2SeqTrainer`, in the style of transformers'
``examples/pytorch/summarization/run_summarization.py`` (much shorter).

    python run_summarization.py --output_dir out --do_train --do_predict --predict_with_generate

Offline by default: a tiny T5 built from a config learns to "summarize" each line of an embedded
text into its subject. ``--model_name_or_path`` loads a real model and tokenizer instead. With
``--do_predict --predict_with_generate`` the main process writes
``generated_predictions.txt``, one line per example, as the transformers example does.
"""

import os
from dataclasses import dataclass, field

from datasets import Dataset
from tiny_assets import SUBJECTS, char_tokenizer, sentences, tiny_seq2seq
from transformers import (
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    HfArgumentParser,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
)


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(default=None, metadata={"help": "default: tiny T5"})
    max_source_length: int = 48
    max_target_length: int = 16


def main():
    parser = HfArgumentParser((ModelArguments, Seq2SeqTrainingArguments))
    model_args, training_args = parser.parse_args_into_dataclasses()
    if model_args.model_name_or_path:
        tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
        model = AutoModelForSeq2SeqLM.from_pretrained(model_args.model_name_or_path)
    else:
        tokenizer = char_tokenizer()
        model = tiny_seq2seq(len(tokenizer), seed=training_args.seed)

    lines = sentences()
    targets = [next(s for s in SUBJECTS if line.startswith(s)) for line in lines]
    raw = Dataset.from_dict({"document": lines, "summary": targets})

    def tokenize(batch):
        inputs = tokenizer(
            batch["document"], max_length=model_args.max_source_length, truncation=True
        )
        labels = tokenizer(
            text_target=batch["summary"], max_length=model_args.max_target_length, truncation=True
        )
        inputs["labels"] = [[*ids, tokenizer.eos_token_id] for ids in labels["input_ids"]]
        return inputs

    with training_args.main_process_first(desc="tokenizing"):
        data = raw.map(tokenize, batched=True, remove_columns=raw.column_names)
    splits = data.train_test_split(test_size=16, seed=0)
    trainer = Seq2SeqTrainer(
        model=model,
        args=training_args,
        train_dataset=splits["train"],
        eval_dataset=splits["test"],
        processing_class=tokenizer,
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model),
    )
    if training_args.do_train:
        result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model()
        trainer.log_metrics("train", result.metrics)
        trainer.save_metrics("train", result.metrics)
        trainer.save_state()
    if training_args.do_eval:
        metrics = trainer.evaluate(max_length=model_args.max_target_length)
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
    if training_args.do_predict:
        predict = trainer.predict(splits["test"], max_length=model_args.max_target_length)
        trainer.log_metrics("predict", predict.metrics)
        trainer.save_metrics("predict", predict.metrics)
        if trainer.is_world_process_zero() and training_args.predict_with_generate:
            ids = predict.predictions
            ids[ids < 0] = tokenizer.pad_token_id  # padding across ranks' batches
            text = tokenizer.batch_decode(ids, skip_special_tokens=True)
            path = os.path.join(training_args.output_dir, "generated_predictions.txt")
            with open(path, "w") as f:
                f.write("\n".join(line.strip() for line in text))


if __name__ == "__main__":
    main()
