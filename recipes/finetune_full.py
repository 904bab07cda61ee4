"""Full fine-tuning of a causal LM with the Hugging Face Trainer on hf_zero.

    accelerate launch --config_file configs/accelerate/cpu_2proc.yaml \\
        recipes/finetune_full.py --zero_stage 2 --output_dir outputs/full

The same data options as finetune_lora.py; every parameter trains. ``save_model`` writes the
whole model, gathered from the shards one group at a time (Hugging Face sharded safetensors):
``AutoModelForCausalLM.from_pretrained(output_dir)``.
An existing DeepSpeed JSON works as it is: ``--zero_config ds_config.json``.

``--model_config config.json`` trains a model built from a config instead (random initial
weights, the embedded tokenizer); under ZeRO-3 it is built inside `hf_zero.partitioned_init()`,
so no rank ever holds it whole - how a model larger than the machine's memory starts, e.g. with
ZeRO-Infinity (``--zero_config configs/zero/ds_zero3_nvme.json``; docs/USER_GUIDE.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from recipe_utils import (
    check_model_source,
    check_pipeline_fits,
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
    model_config: str | None = field(
        default=None,
        metadata={"help": "a model config.json to train from random weights (built partitioned "
                  "under ZeRO-3); the embedded tokenizer"},
    )  # fmt: skip


def model_from_config(path: str, args: ZeroTrainingArguments):
    """A causal LM built from ``path`` (random weights), partitioned under ZeRO-3."""
    import contextlib

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import hf_zero
    from hf_zero.tiny import tiny_tokenizer

    config = AutoConfig.from_pretrained(path)
    tokenizer = tiny_tokenizer()
    if config.vocab_size < len(tokenizer):
        raise ValueError(
            f"--model_config {path!r}: vocab_size {config.vocab_size} is smaller than the "
            f"embedded tokenizer's {len(tokenizer)}"
        )
    torch.manual_seed(args.seed)
    stage3 = args.zero.stage == 3
    build = hf_zero.partitioned_init(args.zero) if stage3 else contextlib.nullcontext()
    with build:
        model = AutoModelForCausalLM.from_config(config)
    return model, tokenizer


def main(argv=None) -> None:
    parser = HfArgumentParser((DataArguments, ZeroTrainingArguments))
    data, args = parse_or_exit(parser.parse_args_into_dataclasses, args=argv)
    parse_or_exit(check_model_source, data.model_name_or_path)
    source, flag = data.model_config or data.model_name_or_path, "--model_config"
    flag = flag if data.model_config else "--model_name_or_path"
    parse_or_exit(check_pipeline_fits, args.zero.pp_size, source, flag)
    logging.basicConfig(level=logging.INFO if args.process_index == 0 else logging.WARNING)
    if data.model_config is not None:
        model, tokenizer = model_from_config(data.model_config, args)
    else:
        model, tokenizer = load_model_and_tokenizer(data.model_name_or_path, seed=args.seed)
    with args.main_process_first(desc="tokenizing"):
        dataset = make_lm_dataset(tokenizer, data.block_size, data.dataset_name, data.text_file)
    train_and_save(model, tokenizer, args, dataset)
    logger.info("saved the model to %s", args.output_dir)


if __name__ == "__main__":
    main()
