"""Full fine-tuning of a causal LM with the Hugging Face Trainer on hf_zero.

    accelerate launch --config_file configs/accelerate/cpu_2proc.yaml \\
        recipes/finetune_full.py --zero_stage 2 --output_dir outputs/full

The same data options as finetune_lora.py; every parameter trains. ``save_model`` writes the
whole model gathered from the shards: ``AutoModelForCausalLM.from_pretrained(output_dir)``.
An existing DeepSpeed JSON works as it is: ``--zero_config ds_config.json``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from recipe_utils import load_model_and_tokenizer, make_lm_dataset, probe_logits, save_run_record
from transformers import HfArgumentParser, default_data_collator

from hf_zero import ZeroTrainer, ZeroTrainingArguments

logger = logging.getLogger("finetune_full")


@dataclass
class DataArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "model to fine-tune; default: the embedded tiny Llama"}
    )
    dataset_name: str | None = field(default=None)
    text_file: str | None = field(default=None)
    block_size: int = field(default=64)


def main(argv=None) -> None:
    parser = HfArgumentParser((DataArguments, ZeroTrainingArguments))
    data, args = parser.parse_args_into_dataclasses(args=argv)
    logging.basicConfig(level=logging.INFO if args.process_index == 0 else logging.WARNING)
    model, tokenizer = load_model_and_tokenizer(data.model_name_or_path, seed=args.seed)
    with args.main_process_first(desc="tokenizing"):
        dataset = make_lm_dataset(tokenizer, data.block_size, data.dataset_name, data.text_file)
    trainer = ZeroTrainer(
        model=model,
        args=args,
        train_dataset=dataset,
        data_collator=default_data_collator,
        processing_class=tokenizer,
    )
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.save_model(args.output_dir)
    save_run_record(trainer, args.output_dir, probe_logits(model, tokenizer, trainer.args.device))
    logger.info("saved the model to %s", args.output_dir)
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main()
