"""Train with TRL's `GRPOTrainer`, in the style of TRL's ``trl/scripts/grpo.py`` (shorter).

    python grpo.py --output_dir out --use_peft --beta 0.04

Offline by default: the tiny Llama of ``tiny_assets`` (saved under ``output_dir/tiny-init``, since
TRL builds a reference model from a path when ``--beta`` is not 0) completes prompts cut from an
embedded text, rewarded for ending its completion early and for using the letter "e".
``--use_peft`` trains LoRA adapters (TRL then disables them for the reference log-probs);
``--model_name_or_path`` loads a real model. The completions are sampled, so two runs agree only
with the same ``--seed``.
"""

from dataclasses import dataclass, field

from datasets import Dataset
from tiny_assets import lora_config, model_for_trl, sentences
from trl import GRPOConfig, GRPOTrainer, TrlParser


@dataclass
class ScriptArguments:
    model_name_or_path: str | None = field(default=None, metadata={"help": "default: tiny Llama"})
    use_peft: bool = False
    lora_r: int = 8


def brevity_and_letter_e(completions: list[str], **kwargs) -> list[float]:
    """Shorter completions and more e's score higher (a reward a tiny model can learn)."""
    return [text.count("e") / 4 - len(text) / 32 for text in completions]


def main():
    script_args, training_args = TrlParser((ScriptArguments, GRPOConfig)).parse_args_and_config()
    path, tokenizer = model_for_trl(script_args.model_name_or_path, training_args)
    peft_config = lora_config(script_args.use_peft, script_args.lora_r)
    prompts = [" ".join(line.split(" ")[:2]) for line in sentences()]  # "the cat", "a dog", ...
    trainer = GRPOTrainer(
        model=path,
        reward_funcs=brevity_and_letter_e,
        args=training_args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    trainer.save_state()


if __name__ == "__main__":
    main()
