"""What the benchmark scripts share."""

from __future__ import annotations


def llama_shape(hidden: int, layers: int, vocab: int, seq_len: int) -> dict:
    """LLaMA-style dimensions from a width and a depth: MLP 8/3 of the hidden size (a multiple
    of 64), 64-wide attention heads, no grouped-query sharing."""
    return dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=seq_len,
    )
