"""Tiles along the sequence: the head and its cross-entropy, and the MLPs, a tile at a time.

Each tile runs under non-reentrant activation checkpointing: its intermediates (a tile's logits,
its MLP's expanded activations) are freed once the tile's output exists and recomputed, one tile
at a time, in backward. So the whole batch's logits never exist, and an MLP's intermediate
activations exist for one tile only. Both are exact: the cross-entropy sums per token (the tiles'
sums add up to the whole sum, divided once by the same count), and an MLP acts on each token
alone.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE = -100
LOGITS_TILE_BYTES = 64 << 20
"""fp32 logits per tile when the tile size is "auto": 64 MiB."""


def logits_tile_tokens(setting: int | str, vocab_size: int) -> int:
    """Tokens per logits tile: ``setting``, or for "auto" as many as fill `LOGITS_TILE_BYTES`."""
    return setting if setting != "auto" else max(1, LOGITS_TILE_BYTES // (4 * vocab_size))


def tiled_loss(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    shift_labels: torch.Tensor,
    num_items_in_batch: torch.Tensor | int | None,
    tile_tokens: int,
) -> torch.Tensor:
    """The causal LM loss of ``head(hidden)`` against ``shift_labels`` (already shifted), as
    transformers' ``ForCausalLMLoss`` computes it (fp32 logits; the sum over non-ignored tokens
    divided by ``num_items_in_batch``, or their mean), with one tile of logits at a time."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    labels = shift_labels.reshape(-1).to(flat.device)
    total = flat.new_zeros((), dtype=torch.float32)
    for start in range(0, flat.shape[0], tile_tokens):
        end = start + tile_tokens
        tile_labels = labels[start:end]
        # The first tile always runs: a batch (or a sequence-parallel slice) with every label
        # ignored still needs a loss connected to the model, whose backward every rank runs.
        if start == 0 or bool((tile_labels != IGNORE).any()):
            total = total + checkpoint(
                _tile_loss, flat[start:end], tile_labels, head, use_reentrant=False
            )
    if num_items_in_batch is None:
        num_items_in_batch = (labels != IGNORE).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def _tile_loss(hidden: torch.Tensor, labels: torch.Tensor, head: torch.nn.Module) -> torch.Tensor:
    logits = head(hidden).float()
    return F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum")


class TiledMLP:
    """An MLP's forward run over ``tiles`` pieces of the sequence (dim 1), each checkpointed."""

    def __init__(self, forward, tile_tokens: int) -> None:
        self.forward, self.tile_tokens = forward, tile_tokens

    def __call__(self, hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if hidden.dim() < 3 or hidden.shape[1] <= self.tile_tokens or args or kwargs:
            return self.forward(hidden, *args, **kwargs)
        tiles = math.ceil(hidden.shape[1] / self.tile_tokens)
        outputs = []
        for piece in hidden.chunk(tiles, dim=1):
            out = checkpoint(self.forward, piece, use_reentrant=False)
            if not torch.is_tensor(out):
                raise NotImplementedError(
                    "hf_zero: tiled_mlp needs MLPs that return one tensor; this one returns "
                    f"{type(out).__name__} (a mixture-of-experts block?). Set tiled_mlp: false"
                )
            outputs.append(out)
        return torch.cat(outputs, dim=1)
