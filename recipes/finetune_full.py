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

from recipe_utils import (
    check_model_source,
    load_model_and_tokenizer,
    make_lm_dataset,
    train_and_save,
)
from transformers import HfArgumentParser

from hf_zero import ZeroTrainingArguments
from hf_zero.launch_errors import parse_or_exit

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
    data, args = parse_or_exit(parser.parse_args_into_dataclasses, args=argv)
    parse_or_exit(check_model_source, data.model_name_or_path)
    logging.basicConfig(level=logging.INFO if args.process_index == 0 else logging.WARNING)
    model, tokenizer = load_model_and_tokenizer(data.model_name_or_path, seed=args.seed)
    with args.main_process_first(desc="tokenizing"):
        dataset = make_lm_dataset(tokenizer, data.block_size, data.dataset_name, data.text_file)
    train_and_save(model, tokenizer, args, dataset)
    logger.info("saved the model to %s", args.output_dir)


if __name__ == "__main__":
    main()
