"""Train with TRL's `DPOTrainer`, in the style of TRL's ``trl/scripts/dpo.py`` (shorter).

    python dpo.py --output_dir out [--use_peft]

Offline by default: the tiny Llama of ``tiny_assets`` (saved under ``output_dir/tiny-init``: TRL
builds the reference model from that path) learns to prefer, after "<subject> <verb>", the
object that the embedded text pairs with that verb over a shuffled one. Full-parameter training
keeps a separate reference model; ``--use_peft`` trains LoRA adapters and uses the base model
(adapters disabled) as the reference. ``--model_name_or_path`` loads a real model.
"""

import random
from dataclasses import dataclass, field

from datasets import Dataset
from tiny_assets import OBJECTS, SUBJECTS, VERBS, lora_config, model_for_trl
from trl import DPOConfig, DPOTrainer, TrlParser


@dataclass
class ScriptArguments:
    model_name_or_path: str | None = field(default=None, metadata={"help": "default: tiny Llama"})
    use_peft: bool = False
    lora_r: int = 8


def preferences(seed: int = 0) -> Dataset:
    """One pair per subject and verb: the verb's own object is chosen, another rejected."""
    rng = random.Random(seed)
    rows = {"prompt": [], "chosen": [], "rejected": []}
    for subject in SUBJECTS:
        for i, verb in enumerate(VERBS):
            other = rng.choice([o for o in OBJECTS if o != OBJECTS[i]])
            rows["prompt"].append(f"{subject} {verb}")
            rows["chosen"].append(f" {OBJECTS[i]}.")
            rows["rejected"].append(f" {other}.")
    return Dataset.from_dict(rows)


def main():
    script_args, training_args = TrlParser((ScriptArguments, DPOConfig)).parse_args_and_config()
    path, tokenizer = model_for_trl(script_args.model_name_or_path, training_args)
    peft_config = lora_config(script_args.use_peft, script_args.lora_r)
    trainer = DPOTrainer(
        model=path,
        args=training_args,
        train_dataset=preferences(training_args.seed),
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    trainer.save_state()


if __name__ == "__main__":
    main()
