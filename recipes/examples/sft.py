"""Supervised fine-tuning with TRL's `SFTTrainer`, in the style of TRL's ``trl/scripts/sft.py``
(shorter).

    python sft.py --output_dir out [--use_peft]

Offline by default: the tiny Llama of ``tiny_assets`` (TRL loads it from ``output_dir/tiny-init``)
on the lines of an embedded text. ``--use_peft`` trains LoRA adapters;
``--model_name_or_path`` loads a real model.
"""

from dataclasses import dataclass, field

from datasets import Dataset
from tiny_assets import lora_config, model_for_trl, sentences
from trl import SFTConfig, SFTTrainer, TrlParser


@dataclass
class ScriptArguments:
    model_name_or_path: str | None = field(default=None, metadata={"help": "default: tiny Llama"})
    use_peft: bool = False
    lora_r: int = 8


def main():
    script_args, training_args = TrlParser((ScriptArguments, SFTConfig)).parse_args_and_config()
    path, tokenizer = model_for_trl(script_args.model_name_or_path, training_args)
    peft_config = lora_config(script_args.use_peft, script_args.lora_r)
    trainer = SFTTrainer(
        model=path,
        args=training_args,
        train_dataset=Dataset.from_dict({"text": sentences()}),
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    trainer.save_state()


if __name__ == "__main__":
    main()
