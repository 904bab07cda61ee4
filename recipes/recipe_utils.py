"""What the recipes share: model + tokenizer loading (with the embedded tiny default), the text
dataset (with the embedded corpus as default) and a fixed probe for checking saved models."""

from __future__ import annotations

import os
import urllib.error
import urllib.request

import torch

from hf_zero.tiny import TINY_DECODER, tiny_corpus, tiny_llama, tiny_tokenizer


def check_model_source(name: str | None) -> None:
    """Raise one clear ``ValueError`` when ``--model_name_or_path`` is neither a local directory,
    nor in the Hugging Face cache, nor a model the Hub answers for (before anything is built)."""
    if name is None or os.path.isdir(name):
        return
    flag = f"--model_name_or_path {name!r}"
    if os.path.exists(name) or name.startswith((".", "/", "~")):
        raise ValueError(f"{flag} is not a directory")
    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return
    if constants.HF_HUB_OFFLINE:
        raise ValueError(f"{flag} is not a local directory and not in the cache (HF_HUB_OFFLINE)")
    request = urllib.request.Request(f"{constants.ENDPOINT}/api/models/{name}", method="HEAD")
    try:
        urllib.request.urlopen(request, timeout=10).close()
    except urllib.error.HTTPError as error:
        if error.code not in (401, 403):  # private or gated: from_pretrained uses your token
            raise ValueError(
                f"{flag} is not a local directory and not a model on the Hub"
            ) from None
    except OSError as error:
        raise ValueError(
            f"{flag} is not a local directory, not in the cache, and the Hub cannot be reached "
            f"({getattr(error, 'reason', error)})"
        ) from None


def check_pipeline_fits(pp_size: int, source: str | None, flag: str) -> None:
    """Raise one clear ``ValueError`` when ``--zero_pp_size`` exceeds the model's decoder layers
    (every stage needs one), read from its config before anything is built."""
    if pp_size <= 1:
        return
    if source is None:
        layers, what = TINY_DECODER["num_hidden_layers"], "the embedded tiny Llama"
    else:
        from transformers import AutoConfig

        layers = getattr(AutoConfig.from_pretrained(source), "num_hidden_layers", None)
        what = f"{flag} {source!r}"
    if layers is not None and pp_size > layers:
        raise ValueError(
            f"--zero_pp_size {pp_size}: {what} has {layers} decoder layer(s), and every pipeline "
            f"stage needs at least one (--zero_pp_size 1 to {layers})"
        )


def load_model_and_tokenizer(model_name_or_path: str | None, seed: int = 0):
    """``(model, tokenizer)``: a Hub/local causal LM, or the embedded tiny Llama when None.

    The tiny default is initialised with ``initializer_range=0.3`` (not 0.02): its frozen random
    embeddings then span a wide enough range of logits for LoRA adapters alone to learn the
    text in a CPU demo. A real run starts from pretrained weights instead.
    """
    tokenizer = load_tokenizer(model_name_or_path)
    if model_name_or_path is None:
        # The config names the tokenizer's own EOS and PAD ids, so the Trainer has nothing to
        # align (and says nothing about it).
        model = tiny_llama(
            seed=seed,
            vocab_size=len(tokenizer),
            initializer_range=0.3,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        return model, tokenizer
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_name_or_path), tokenizer


def load_tokenizer(model_name_or_path: str | None):
    """The model's tokenizer (a pad token added if it has none), or the embedded one."""
    if model_name_or_path is None:
        return tiny_tokenizer()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_name_or_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def add_lora(model, lora):
    """``get_peft_model(model, lora)``. PEFT reads ``model.is_gradient_checkpointing``, which
    transformers now deprecates with a FutureWarning on every call: a notice for PEFT, not for
    the user, so that one warning is silenced here."""
    import warnings

    from peft import get_peft_model

    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning
        )
        return get_peft_model(model, lora)


def load_quantized_base(source: str, quantization: str, args):
    """The model at ``source`` loaded through bitsandbytes (QLoRA): ``nf4``/``fp4`` with 4-bit
    codes stored in the compute dtype (``bnb_4bit_quant_storage``, what ZeRO-3/FSDP recipes
    use), or ``int8``. The compute dtype follows ``--bf16``/``--fp16`` (else fp32). Under ZeRO-3
    it loads inside `hf_zero.partitioned_init()`: each weight is quantized as it is read and
    every rank keeps only its slice, so no rank holds the whole model, 16-bit or quantized."""
    import contextlib

    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    import hf_zero

    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    if quantization == "int8":
        config = BitsAndBytesConfig(load_in_8bit=True)
    else:
        config = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=quantization,
            bnb_4bit_compute_dtype=dtype,
            bnb_4bit_quant_storage=dtype,
        )
    stage3 = args.zero.stage == 3
    build = hf_zero.partitioned_init(args.zero) if stage3 else contextlib.nullcontext()
    with build:
        return AutoModelForCausalLM.from_pretrained(source, quantization_config=config, dtype=dtype)


def save_embedded_base(model, tokenizer, args) -> str:
    """Save the embedded tiny base to ``<output_dir>/base_model`` and make that its name.

    It has no Hub id, and rebuilding it needs the seed, vocabulary size and init range the run
    used; a saved copy (config.json + model.safetensors, about 0.4 MB) loads with
    ``from_pretrained`` and nothing else. The path is absolute because PEFT (and
    ``AutoPeftModelForCausalLM``) resolve ``base_model_name_or_path`` from the current
    directory; ``hf_zero.load_for_inference`` also finds ``base_model/`` next to a moved adapter.
    Call it before ``get_peft_model``, which records ``model.name_or_path`` in adapter_config.json.
    """
    import os

    path = os.path.abspath(os.path.join(args.output_dir, "base_model"))
    if args.should_save:
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    model.name_or_path = path
    return path


def make_lm_dataset(tokenizer, block_size: int, dataset_name=None, text_file=None):
    """Causal-LM examples of ``block_size`` tokens (labels = inputs) from a text source."""
    from datasets import Dataset, load_dataset

    if dataset_name:
        raw = load_dataset(dataset_name, split="train")
    elif text_file:
        raw = load_dataset("text", data_files=text_file, split="train")
    else:
        raw = Dataset.from_dict({"text": [p for p in tiny_corpus().split("\n") if p]})

    def tokenize(batch):
        return tokenizer([t + tokenizer.eos_token for t in batch["text"]])

    def group(batch):
        ids = [i for seq in batch["input_ids"] for i in seq]
        usable = len(ids) // block_size * block_size
        blocks = [ids[i : i + block_size] for i in range(0, usable, block_size)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

    tokenized = raw.map(tokenize, batched=True, remove_columns=raw.column_names)
    return tokenized.map(group, batched=True, remove_columns=tokenized.column_names)


def train_and_save(model, tokenizer, args, dataset, after_save=None) -> None:
    """The Trainer part every Trainer recipe shares: train (or resume), save, record, tear down.

    Also writes, on rank 0, the logits of a fixed probe and the log history, so that a fresh
    process (the tests, or you) can check that what was saved reproduces the trained model.
    ``after_save(trainer)`` runs on every rank after saving, while the process group is up.
    """
    from transformers import default_data_collator

    from hf_zero import ZeroTrainer
    from hf_zero.integrations.run_claim import RunRefused
    from hf_zero.launch_errors import exit_with

    trainer = ZeroTrainer(
        model=model,
        args=args,
        train_dataset=dataset,
        data_collator=default_data_collator,
        processing_class=tokenizer,
    )
    try:
        trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    except RunRefused as refusal:  # another run's folder: one line, exit 2, before training
        exit_with(str(refusal))
    trainer.save_model(args.output_dir)
    save_run_record(trainer, args.output_dir, probe_logits(model, tokenizer, args.device))
    if after_save is not None:
        after_save(trainer)
    trainer.accelerator.end_training()  # tears the process group down cleanly


def save_run_record(trainer, output_dir: str, logits: torch.Tensor) -> None:
    """Rank 0: the probe logits and the Trainer's log history, for checking a run afterwards."""
    import json

    if trainer.args.process_index == 0:
        torch.save(logits, f"{output_dir}/probe_logits.pt")
        with open(f"{output_dir}/log_history.json", "w") as f:
            json.dump(trainer.state.log_history, f, indent=1)


@torch.no_grad()
def probe_logits(model, tokenizer, device) -> torch.Tensor:
    """Logits of a fixed sentence (collective under ZeRO-3: every rank must call it)."""
    model.eval()
    ids = tokenizer("The lighthouse keeper wrote", return_tensors="pt")["input_ids"].to(device)
    return model(input_ids=ids).logits.float().cpu()
