"""Full-sequence attention masks for sequence-parallel attention.

Inside Ulysses attention every rank sees the whole sequence (for its share of the heads), but the
model built its mask for the rank's slice of the sequence only. The mask is therefore made here,
once per forward and window, from the whole batch's ``attention_mask`` and ``position_ids``, with
the rules transformers applies to an unsharded sequence: causal; keys that are padding masked;
without an ``attention_mask`` and without a KV cache, rows packed with several sequences
(``position_ids`` restarting) attend within their own sequence only; a sliding window when the
layer has one.
"""

from __future__ import annotations

import torch


def packed_segments(position_ids: torch.Tensor) -> torch.Tensor:
    """Per token, the index of its sequence within the row: a new one starts wherever the
    position does not follow the previous one by 1 (as transformers detects packing)."""
    first = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)


def is_packed(position_ids: torch.Tensor) -> bool:
    """Whether some row holds more than one sequence."""
    return bool((packed_segments(position_ids)[:, -1] > 0).any())


def allowed_keys(
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    window: int | None,
    seq: int,
) -> torch.Tensor:
    """``[batch, 1, seq, seq]`` booleans: whether query ``i`` may attend to key ``j``.

    A query with no allowed key (a padding token before any real one) attends to itself, so
    that no row of the softmax is empty: its output is finite, and unused (its key is masked for
    every other query, its label ignored). ``position_ids``: packed rows to keep apart, or None."""
    device = (attention_mask if attention_mask is not None else position_ids).device
    index = torch.arange(seq, device=device)
    allowed = (index[None, :] <= index[:, None])[None]
    if window is not None:
        allowed = allowed & (index[:, None] - index[None, :] < window)[None]
    if attention_mask is not None:
        allowed = allowed & attention_mask.bool()[:, None, :]
    elif position_ids is not None:
        segments = packed_segments(position_ids)
        allowed = allowed & (segments[:, :, None] == segments[:, None, :])
    allowed = allowed | (
        ~allowed.any(-1, keepdim=True) & torch.eye(seq, dtype=torch.bool, device=index.device)
    )
    return allowed[:, None]


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The same mask as the additive float form eager attention adds to its scores."""
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)
