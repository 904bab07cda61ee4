"""What the example scripts need to run offline: a character tokenizer, a tiny model built from
a config, and a few hundred lines of text. Plain transformers; nothing here knows of hf_zero.

With ``--model_name_or_path`` the scripts load a real model and tokenizer instead.
"""

from __future__ import annotations

import os

import torch
from transformers import PreTrainedTokenizerFast

SUBJECTS = ["the cat", "a dog", "my friend", "the old man", "a small bird", "the teacher"]
VERBS = ["sees", "likes", "finds", "draws", "follows", "calls"]
OBJECTS = ["the river", "a red ball", "the garden", "an open door", "the moon", "a letter"]


def sentences() -> list[str]:
    """Every subject-verb-object sentence of the three word lists (216 lines)."""
    return [f"{s} {v} {o}." for s in SUBJECTS for v in VERBS for o in OBJECTS]


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable ASCII character, plus pad (0), eos (1) and bos (2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<pad>": 0, "</s>": 1, "<s>": 2, **{chr(c): c - 29 for c in range(32, 127)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.decoder = decoders.Fuse()  # characters back into text, no spaces between
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>", bos_token="<s>"
    )


def tiny_causal_lm(vocab_size: int, seed: int = 0):
    """A freshly initialised 2-layer Llama (hidden 64)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    return LlamaForCausalLM(config)


def tiny_seq2seq(vocab_size: int, seed: int = 0):
    """A freshly initialised 2+2-layer T5 (d_model 64)."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    config = T5Config(
        vocab_size=vocab_size,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_heads=4,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    return T5ForConditionalGeneration(config)


def saved_tiny_causal_lm(output_dir: str, main_process_first) -> str:
    """Save the tiny Llama and its tokenizer under ``output_dir/tiny-init`` (main process
    first) and return the path: TRL builds reference models from a model path."""
    path = os.path.join(output_dir, "tiny-init")
    with main_process_first(desc="saving the tiny model"):
        if not os.path.isdir(path):
            tokenizer = char_tokenizer()
            tiny_causal_lm(len(tokenizer)).save_pretrained(path)
            tokenizer.save_pretrained(path)
    return path


def model_for_trl(model_name_or_path: str | None, training_args):
    """``(model path, tokenizer)`` for a TRL trainer: the model given, or the tiny Llama saved
    under ``output_dir/tiny-init`` (TRL builds reference models from a model path)."""
    if model_name_or_path:
        from transformers import AutoTokenizer

        return model_name_or_path, AutoTokenizer.from_pretrained(model_name_or_path)
    path = saved_tiny_causal_lm(training_args.output_dir, training_args.main_process_first)
    return path, char_tokenizer()


def lora_config(use_peft: bool, r: int):
    """LoRA on every linear layer when ``use_peft``, else None (full-parameter training)."""
    if not use_peft:
        return None
    from peft import LoraConfig

    return LoraConfig(r=r, target_modules="all-linear", task_type="CAUSAL_LM")
