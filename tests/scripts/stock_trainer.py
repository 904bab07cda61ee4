"""A plain transformers training script: no hf_zero import anywhere, no device settings.

    python stock_trainer.py --output_dir DIR [--subclass | --trl [--lora] [--qlora nf4|int8]]
        [--evaluate_first] [TrainingArguments]

Its arguments are parsed as the transformers examples parse theirs (``HfArgumentParser`` over
``TrainingArguments``, or TRL's ``SFTConfig``), so every Trainer flag works and nothing is set
that a user would not type. Writes DIR/report_rank<R>.json: the Trainer class's MRO, whether
hf_zero was imported, the world size and main-process flag the Trainer saw, the element count of
each parameter as the model exposes it mid-training, the log history and the final logits of a
fixed probe (every rank computes them).
"""

import json
import os
import sys
from dataclasses import dataclass

import torch
from transformers import (
    HfArgumentParser,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)


@dataclass
class ScriptArguments:
    subclass: bool = False
    trl: bool = False
    lora: bool = False
    qlora: str = ""  # with --trl: load the model by path through bitsandbytes, as QLoRA scripts do
    evaluate_first: bool = False  # a baseline trainer.evaluate() before trainer.train()


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
    use_trl = "--trl" in sys.argv
    if use_trl:
        from trl import SFTConfig as Config
    else:
        Config = TrainingArguments
    script, training_args = HfArgumentParser(
        (ScriptArguments, Config)
    ).parse_args_into_dataclasses()
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
    ids = torch.randint(2, 96, (32, 16), generator=torch.Generator().manual_seed(1))
    if use_trl:
        from datasets import Dataset
        from trl import SFTTrainer

        peft_config = None
        if script.lora:
            from peft import LoraConfig

            peft_config = LoraConfig(
                r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"
            )
        if script.qlora:
            from transformers import BitsAndBytesConfig

            path = os.path.join(training_args.output_dir, "base")
            with training_args.main_process_first(desc="saving the base"):
                if training_args.process_index == 0:
                    model.save_pretrained(path)
            model = path  # TRL loads it with model_init_kwargs, as its own sft.py does
            quantization = (
                BitsAndBytesConfig(load_in_8bit=True)
                if script.qlora == "int8"
                else BitsAndBytesConfig(
                    load_in_4bit=True,
                    bnb_4bit_quant_type=script.qlora,
                    bnb_4bit_compute_dtype=torch.float32,
                    bnb_4bit_quant_storage=torch.float32,
                )
            )
            training_args.model_init_kwargs = {
                "quantization_config": quantization,
                "dtype": torch.float32,
            }
        text = ["".join(chr(int(i) + 30) for i in row) for row in ids]
        trainer = SFTTrainer(
            model=model,
            args=training_args,
            train_dataset=Dataset.from_dict({"text": text}),
            eval_dataset=Dataset.from_dict({"text": text[:8]}) if script.evaluate_first else None,
            processing_class=tokenizer(),
            callbacks=[Report()],
            peft_config=peft_config,
        )
    else:
        cls = Trainer
        if script.subclass:

            class MyTrainer(Trainer):
                def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
                    return super().compute_loss(model, inputs, return_outputs, **kwargs)

            cls = MyTrainer
        data = [{"input_ids": row, "labels": row} for row in ids]
        trainer = cls(model=model, args=training_args, train_dataset=data, eval_dataset=data[:8])
        trainer.add_callback(Report())
    baseline = trainer.evaluate()["eval_loss"] if script.evaluate_first else None
    trainer.train()
    trainer.save_model(training_args.output_dir)
    model = trainer.model
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids[:2].to(training_args.device)).logits.float().cpu()
    rank = int(os.environ.get("RANK", 0))
    report = {
        "mro": [c.__name__ for c in type(trainer).__mro__],
        "hf_zero_imported": "hf_zero" in sys.modules,
        "world_size": training_args.world_size,
        "is_world_process_zero": trainer.is_world_process_zero(),
        "sizes": Report.sizes,
        "log_history": trainer.state.log_history,
        "logits": logits.tolist(),
        "baseline_eval_loss": baseline,
    }
    with open(os.path.join(training_args.output_dir, f"report_rank{rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
