"""LoRA fine-tuning of a causal LM with the Hugging Face Trainer on hf_zero.

    accelerate launch --config_file configs/accelerate/cpu_2proc.yaml \\
        recipes/finetune_lora.py --zero_stage 3 --output_dir outputs/lora

With no ``--model_name_or_path`` it trains the embedded tiny Llama on the embedded text, offline,
in about a minute on two CPU processes. Any causal LM and any text dataset work the same way
(``--model_name_or_path``, ``--dataset_name``/``--text_file``). Every Trainer flag applies, plus
hf_zero's (``--zero_stage``, ``--zero_config``, ``--zero_offload_optimizer``, ...). The adapter is
saved in PEFT format, with ``base_model_name_or_path`` in adapter_config.json (the embedded
base is saved to ``output_dir/base_model``) and ``hf_zero_training.json`` (how the base was
quantized): ``hf_zero.load_for_inference(None, output_dir)`` rebuilds the trained model exactly;
``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), output_dir)`` loads the
adapter on the unquantized base.

Under ZeRO-3 the frozen base weights are stored as INT8 shards (MixZ++) unless you say otherwise
(``--mixz false``, or ``quantized_nontrainable_weights`` in a flag or config file): the base costs
1/N byte per parameter per rank instead of 2. ``--merged_output_dir DIR`` also writes the base
with the adapter merged in (a plain model for ``from_pretrained``; under MixZ++ the base part is
the dequantized INT8 weights the adapter was trained against).

QLoRA: ``--quantization nf4`` (or ``fp4``, ``int8``) loads the base through bitsandbytes (as
``from_pretrained(..., quantization_config=BitsAndBytesConfig(...))``; under ZeRO-3 inside
``hf_zero.partitioned_init()``, so each rank keeps only its slice of each weight as it loads);
its codes are sharded and gathered as bytes at every stage, and MixZ++ is not switched on by
default (the base is quantized already; its embeddings and norms stay as loaded). The adapter
reloads on a base loaded with the same ``BitsAndBytesConfig``; a merged export dequantizes the
base.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from recipe_utils import (
    add_lora,
    check_model_source,
    check_pipeline_fits,
    load_model_and_tokenizer,
    load_quantized_base,
    load_tokenizer,
    make_lm_dataset,
    save_embedded_base,
    train_and_save,
)
from transformers import HfArgumentParser

import hf_zero
from hf_zero import ZeroTrainingArguments
from hf_zero.launch_errors import parse_or_exit

logger = logging.getLogger("finetune_lora")


@dataclass
class LoraArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "model to fine-tune; default: the embedded tiny Llama"}
    )
    dataset_name: str | None = field(
        default=None, metadata={"help": "a `datasets` dataset with a 'text' column"}
    )
    text_file: str | None = field(default=None, metadata={"help": "a plain-text training file"})
    block_size: int = field(default=64, metadata={"help": "tokens per training example"})
    lora_r: int = field(default=16)
    lora_alpha: int = field(default=16)
    lora_dropout: float = field(default=0.0)
    mixz: bool = field(
        default=True,
        metadata={"help": "ZeRO-3: keep the frozen base as INT8 shards (MixZ++) by default"},
    )
    quantization: str = field(
        default="none",
        metadata={
            "help": "QLoRA: load the base through bitsandbytes as 'nf4', 'fp4' (4-bit, storage "
            "in the compute dtype, as ZeRO-3/FSDP recipes do) or 'int8' (LLM.int8); 'none' "
            "keeps it 16/32-bit",
            "choices": ["none", "nf4", "fp4", "int8"],
        },
    )
    merged_output_dir: str | None = field(
        default=None, metadata={"help": "also save base + merged adapter here, for inference"}
    )
    lora_target_modules: str = field(
        default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
        metadata={"help": "comma-separated module names, or 'all-linear'"},
    )


def main(argv=None) -> None:
    parser = HfArgumentParser((LoraArguments, ZeroTrainingArguments))
    script, args = parse_or_exit(parser.parse_args_into_dataclasses, args=argv)
    parse_or_exit(check_model_source, script.model_name_or_path)
    source = script.model_name_or_path
    parse_or_exit(check_pipeline_fits, args.zero.pp_size, source, "--model_name_or_path")
    logging.basicConfig(level=logging.INFO if args.process_index == 0 else logging.WARNING)
    from peft import LoraConfig

    key = "quantized_nontrainable_weights"
    # A bitsandbytes base is quantized already: its other frozen weights (embeddings, norms)
    # stay as loaded, so the adapter reloads exactly on the same BitsAndBytesConfig.
    mixz = script.mixz and script.quantization == "none"
    if mixz and args.zero.stage == 3 and not args.zero_setting_given(key):
        args.zero = args.zero.replace(**{key: True})

    source = script.model_name_or_path
    if script.quantization != "none" and source is not None:
        tokenizer = load_tokenizer(source)  # the 16-bit model is never loaded whole
    else:
        model, tokenizer = load_model_and_tokenizer(source, seed=args.seed)
        with args.main_process_first(desc="saving the base"):  # rank 0 writes, then all read
            if source is None:  # adapter_config.json must name a loadable base
                source = save_embedded_base(model, tokenizer, args)
    if script.quantization != "none":
        model = load_quantized_base(source, script.quantization, args)
    targets = script.lora_target_modules
    lora = LoraConfig(
        r=script.lora_r,
        lora_alpha=script.lora_alpha,
        lora_dropout=script.lora_dropout,
        target_modules=targets if targets == "all-linear" else targets.split(","),
        task_type="CAUSAL_LM",
    )
    model = add_lora(model, lora)
    if args.process_index == 0:
        model.print_trainable_parameters()
    with args.main_process_first(desc="tokenizing"):
        dataset = make_lm_dataset(
            tokenizer, script.block_size, script.dataset_name, script.text_file
        )

    def save_merged(trainer) -> None:
        if script.merged_output_dir:
            hf_zero.save_merged(trainer.engine, model, script.merged_output_dir, tokenizer)
            logger.info("saved the merged model to %s", script.merged_output_dir)

    train_and_save(model, tokenizer, args, dataset, after_save=save_merged)
    logger.info("saved the adapter to %s", args.output_dir)


if __name__ == "__main__":
    main()
