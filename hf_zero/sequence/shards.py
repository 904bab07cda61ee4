"""The batch split along the sequence, and the loss put back together, for sequence parallelism.

Every rank of a sequence-parallel group receives the same batch (the data loader is sharded over
the groups, not the ranks). `SequenceShards.split` keeps this rank's slice of every sequence:
the labels are shifted over the whole sequence first (the last token of a slice predicts the
first of the next), positions come from the whole sequence, and the loss's divisor is the count
of non-ignored tokens of the whole batch (or the Trainer's ``num_items_in_batch``), so each rank's
loss is its tokens' share of the unsharded loss. `sum_over_group` adds the shares: every rank
reports the unsharded loss.

Gradients: each rank's backward yields its share of the gradient; ZeRO averages over every rank
(data x sequence parallel), so the backward of `sum_over_group` multiplies by the group size,
which makes that average the data-parallel mean of the unsharded gradient.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hf_zero.comm import Collectives
from hf_zero.comm.topology import Group
from hf_zero.sequence import masks
from hf_zero.sequence.tiles import IGNORE

logger = logging.getLogger(__name__)


class SequenceShards:
    """This rank's slice of the current batch, and the whole batch's attention masks (kept
    until the next batch: recomputation under gradient checkpointing reads them in backward)."""

    def __init__(self, group: Group, comm: Collectives, pad_token_id: int | None) -> None:
        self.group, self.comm = group, comm
        self.index = group.rank_of(dist.get_rank())
        self.pad_token_id = pad_token_id or 0
        self._attention_mask: torch.Tensor | None = None
        self._packed: torch.Tensor | None = None
        self._length = 0
        self.length = 0
        """The current batch's sequence length before padding to a multiple of sp."""
        self._plain = True
        self._masks: dict = {}
        self._said: set[str] = set()

    def split(self, inputs: dict, cached: bool) -> dict:
        """The causal LM's keyword inputs for this rank's slice of every sequence. ``cached``:
        whether the unsharded model would have made a KV cache for them."""
        sp = self.group.size
        tokens = inputs.get("input_ids")
        tokens = tokens if tokens is not None else inputs["inputs_embeds"]
        batch, length = tokens.shape[:2]
        labels, shift = inputs.pop("labels", None), inputs.pop("shift_labels", None)
        if shift is None and labels is not None:
            shift = F.pad(labels, (0, 1), value=IGNORE)[:, 1:]
        attention_mask = inputs.pop("attention_mask", None)
        positions = inputs.pop("position_ids", None)
        if positions is None:
            positions = torch.arange(length, device=tokens.device)[None]
        positions = positions.expand(batch, -1)
        pad = -length % sp
        if pad:
            self._say_once(
                f"hf_zero: sequence length {length} padded to {length + pad} so that sp_size "
                f"{sp} divides it (the padding is masked out and ignored by the loss)"
            )
            if attention_mask is None:
                attention_mask = torch.ones(batch, length, dtype=torch.long, device=tokens.device)
            attention_mask = F.pad(attention_mask, (0, pad), value=0)
            positions = torch.cat(
                [positions, positions[:, -1:] + 1 + torch.arange(pad, device=tokens.device)], 1
            )
            shift = None if shift is None else F.pad(shift, (0, pad), value=IGNORE)
            for name, value in (("input_ids", self.pad_token_id), ("inputs_embeds", 0.0)):
                if inputs.get(name) is not None:
                    widths = (0, 0, 0, pad) if name == "inputs_embeds" else (0, pad)
                    inputs[name] = F.pad(inputs[name], widths, value=value)
        self._attention_mask, self._packed, self._masks = attention_mask, None, {}
        self._length, self.length = length + pad, length
        if attention_mask is None and masks.is_packed(positions):
            # As transformers: packed rows are kept apart only when no KV cache is made.
            if cached:
                self._say_once(
                    "hf_zero: position_ids restart inside rows but use_cache is on: "
                    "attention crosses the packed sequences, as transformers does without "
                    "hf_zero; pass use_cache=False to keep them apart"
                )
            else:
                self._packed = positions
        self._plain = self._packed is None and (
            attention_mask is None or bool(attention_mask.bool().all())
        )
        piece = (length + pad) // sp
        mine = slice(self.index * piece, (self.index + 1) * piece)
        for name in ("input_ids", "inputs_embeds"):
            if inputs.get(name) is not None:
                inputs[name] = inputs[name][:, mine].contiguous()
        inputs["position_ids"] = positions[:, mine].contiguous()
        inputs["use_cache"] = False
        if shift is not None:
            if inputs.get("num_items_in_batch") is None:
                inputs["num_items_in_batch"] = (shift != IGNORE).sum()
            inputs["labels"] = inputs["shift_labels"] = shift[:, mine].contiguous()
        return inputs

    def mask(self, window: int | None, additive: torch.dtype | None) -> torch.Tensor | None:
        """The whole batch's mask for a layer with ``window`` (None: full attention): booleans,
        or the additive float form in ``additive``; None when plain causality is all it takes
        and booleans were asked for (sdpa then runs its causal kernels)."""
        if window is None and additive is None and self._plain:
            return None
        key = (window, additive)
        if key not in self._masks:
            allowed = masks.allowed_keys(self._attention_mask, self._packed, window, self._length)
            self._masks[key] = allowed if additive is None else masks.additive(allowed, additive)
        return self._masks[key]

    def _say_once(self, message: str) -> None:
        if message not in self._said and dist.get_rank() == 0:
            logger.warning(message)
        self._said.add(message)


def sum_over_group(loss: torch.Tensor, group: Group, comm: Collectives) -> torch.Tensor:
    """The sum of ``loss`` over ``group``; its backward scales by the group size (see above)."""
    return _SumOverGroup.apply(loss, group, comm)


class _SumOverGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, loss, group, comm):
        ctx.size = group.size
        total = loss.detach().clone()
        comm.all_reduce(total, group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.size, None, None


def gather_sequence(
    piece: torch.Tensor, group: Group, comm: Collectives, length: int | None = None
) -> torch.Tensor:
    """Every rank's slice of a per-token tensor (batch x slice) joined along the sequence, on
    every rank of ``group``. Backward hands each rank the group's summed gradient of its slice:
    every rank computes the same loss from the whole, so that sum is the group size times one
    rank's, which ZeRO's average over data x sequence parallel ranks makes the data-parallel
    mean (as `sum_over_group` does for the model's own loss). ``length``: the first tokens
    kept (the padding that made sp divide the sequence dropped)."""
    whole = _GatherSequence.apply(piece, group, comm)
    return whole if length is None else whole[:, :length]


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, piece, group, comm):
        ctx.group, ctx.comm, ctx.index = group, comm, group.rank_of(dist.get_rank())
        # Gathered along dim 0 (rank order), then each rank's block put back in its place.
        flat = piece.detach().contiguous()
        flat = flat.to(torch.uint8) if flat.dtype == torch.bool else flat  # gloo sends bytes
        whole = flat.new_empty((group.size, *flat.shape))
        comm.all_gather(whole.view(-1), flat.view(-1), group)
        whole = whole.movedim(0, 1).reshape(flat.shape[0], -1, *flat.shape[2:])
        return whole.to(piece.dtype)

    @staticmethod
    def backward(ctx, grad):
        total = grad.contiguous().clone()
        ctx.comm.all_reduce(total, ctx.group)
        width = total.shape[1] // ctx.group.size
        return total[:, ctx.index * width : (ctx.index + 1) * width], None, None
