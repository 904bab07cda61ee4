"""An embedded tiny model and text, so examples and tests run offline in seconds.

The tokenizer is UTF-8 bytes (vocabulary 256), so no tokenizer files are needed.
"""

from __future__ import annotations

from importlib import resources

import torch

TINY_DECODER = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=True,
)
"""The tiny decoder's dimensions (GQA: 4 query heads, 2 KV heads), shared by the models below."""


def tiny_llama_config(**overrides):
    """A LlamaConfig small enough for CPU tests; ``overrides`` change any field."""
    from transformers import LlamaConfig

    return LlamaConfig(**{**TINY_DECODER, **overrides})


def tiny_llama(seed: int = 0, **overrides) -> torch.nn.Module:
    """A freshly initialised tiny ``LlamaForCausalLM``, identical for identical seeds."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(**overrides))


def tiny_qwen3(seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny ``Qwen3ForCausalLM`` (per-head q/k norms), same dimensions as `tiny_llama`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    return Qwen3ForCausalLM(Qwen3Config(**{**TINY_DECODER, "head_dim": 16, **overrides}))


def tiny_corpus() -> str:
    """A few paragraphs of plain English prose shipped with the package."""
    return resources.files("hf_zero").joinpath("data/tiny_corpus.txt").read_text(encoding="utf-8")


def byte_tokens(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def token_batches(seq_len: int, batch_size: int, rank: int = 0, world_size: int = 1, seed: int = 0):
    """An endless stream of ``(batch_size, seq_len)`` windows of the corpus, disjoint per rank.

    Window starts are drawn from a generator seeded by ``seed``; rank ``r`` takes every
    ``world_size``-th draw, like a distributed sampler.
    """
    tokens = byte_tokens(tiny_corpus())
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(tokens) - seq_len, (batch_size * world_size,), generator=g)
        mine = starts[rank::world_size]
        yield torch.stack([tokens[s : s + seq_len] for s in mine.tolist()])


def tiny_tokenizer():
    """A byte-level tokenizer built in code (256 byte tokens + ``<eos>``, ``<pad>``): no files.

    Token ``i < 256`` is the byte ``i``, as in `byte_tokens`, so the embedded model and corpus
    work with or without it.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_to_char = _bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(256)}
    assert set(vocab) == set(alphabet)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<pad>")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what ByteLevel pre-tokenizes to)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars
