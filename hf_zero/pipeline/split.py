"""Cut a Hugging Face causal LM into pipeline stages: the Llama family (``model.embed_tokens /
layers / norm``: Llama, Qwen2/3, Mistral, ...) and the GPT-2 family (``transformer.wte / wpe /
h / ln_f``).

Stage 0 holds the token (and GPT-2's position) embedding and the first decoder layers, the last
stage the last layers, the final norm and the LM head; layers go to stages contiguously. Every
stage recomputes what is cheap and identical everywhere instead of sending it: position ids
(``arange``, as the model does without a cache), rotary embeddings and the 4-D attention mask
(from the 2-D padding mask, which travels with the hidden states). A tied head (``tie_word_embeddings``) becomes a copy on
the last stage; `sync_tied_grads` sums the two copies' gradients so both take the tied update.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

PARTITIONS = ("parameters", "uniform")


def partition_layers(
    layer_sizes: Sequence[int], pp_size: int, how: str | Sequence[int] = "parameters",
    first_extra: int = 0, last_extra: int = 0,
) -> list[range]:  # fmt: skip
    """Contiguous layer ranges, one per stage.

    ``how``: ``"parameters"`` balances the stages' parameter counts (the embedding counted on the
    first stage, ``first_extra``, the norm and head on the last, ``last_extra``) by minimising
    the largest stage; ``"uniform"`` gives equal layer counts (the first stages one more when
    they do not divide); a list gives each stage's layer count.
    """
    n = len(layer_sizes)
    if pp_size < 1 or pp_size > n:
        raise ValueError(f"pp_size = {pp_size} must be between 1 and the {n} decoder layers")
    if not isinstance(how, str):
        counts = list(how)
        if len(counts) != pp_size or sum(counts) != n or min(counts) < 1:
            raise ValueError(
                f"pp_partition = {counts}: expected {pp_size} positive layer counts summing to {n}"
            )
    elif how == "uniform":
        counts = [n // pp_size + (s < n % pp_size) for s in range(pp_size)]
    elif how == "parameters":
        counts = _balanced(list(layer_sizes), pp_size, first_extra, last_extra)
    else:
        raise ValueError(
            f"pp_partition = {how!r} is not allowed; expected one of {PARTITIONS} or a list of "
            "layer counts"
        )
    bounds, start = [], 0
    for count in counts:
        bounds.append(range(start, start + count))
        start += count
    return bounds


def _balanced(sizes: list[int], parts: int, first: int, last: int) -> list[int]:
    """Layer counts minimising the largest stage (exact dynamic programme, O(n^2 p))."""
    n = len(sizes)
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)

    def cost(i: int, j: int, stage: int) -> int:  # layers [i, j) on `stage`
        extra = (first if stage == 0 else 0) + (last if stage == parts - 1 else 0)
        return prefix[j] - prefix[i] + extra

    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for p in range(1, parts + 1):
        for j in range(p, n - (parts - p) + 1):
            for i in range(p - 1, j):
                value = max(best[p - 1][i], cost(i, j, p - 1))
                if value < best[p][j]:
                    best[p][j], cut[p][j] = value, i
    counts, j = [], n
    for p in range(parts, 0, -1):
        i = cut[p][j]
        counts.append(j - i)
        j = i
    return counts[::-1]


@dataclass
class DecoderLayout:
    """Where a causal LM keeps the parts a stage needs (attribute names differ by family)."""

    embed: nn.Embedding
    layers: nn.ModuleList
    norm: nn.Module
    positions: nn.Embedding | None = None
    """Learned position embedding added to the token embedding (GPT-2's ``wpe``)."""
    dropout: nn.Module | None = None
    """Dropout after the embedding (GPT-2's ``drop``)."""
    rotary: nn.Module | None = None
    """Rotary embedding every stage computes for its layers (Llama's ``rotary_emb``)."""


def decoder_layout(model: nn.Module) -> DecoderLayout:
    """The parts of ``model``; a clear error for a model of neither supported family."""
    base = getattr(model, "model", None)
    if base is not None and all(hasattr(base, a) for a in ("embed_tokens", "layers", "norm")):
        return DecoderLayout(
            base.embed_tokens, base.layers, base.norm, rotary=getattr(base, "rotary_emb", None)
        )
    base = getattr(model, "transformer", None)
    if base is not None and all(hasattr(base, a) for a in ("wte", "wpe", "h", "ln_f")):
        return DecoderLayout(base.wte, base.h, base.ln_f, base.wpe, getattr(base, "drop", None))
    raise NotImplementedError(
        f"hf_zero pipeline: {type(model).__name__} has neither the Llama-family layout "
        "(model.embed_tokens / layers / norm) nor the GPT-2 one (transformer.wte / wpe / h / "
        "ln_f); other layouts cannot be cut into stages yet"
    )


class CausalLMStage(nn.Module):
    """One stage of a decoder-only LM. Stage 0 takes ``input_ids``; the others take the hidden
    states. Every stage but the last returns ``(hidden_states, attention_mask)`` (the mask is
    the 2-D padding mask or an empty tensor for none); the last returns the logits."""

    def __init__(self, model: nn.Module, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        parts = decoder_layout(model)
        self.config = model.config
        self.first, self.last = first, last
        self.tied = model.lm_head.weight is parts.embed.weight
        """The head shares the embedding's weight: first and last stage hold a copy each."""
        self.layer_indices = list(layers)
        self.embed_tokens = parts.embed if first else None
        self.positions = parts.positions if first else None
        self.dropout = parts.dropout if first else None
        self.layers = nn.ModuleList(parts.layers[i] for i in layers)
        self.rotary_emb = parts.rotary
        self.norm = parts.norm if last else None
        self.lm_head = None
        if last:
            head = model.lm_head
            if self.tied and not first:
                head = copy.deepcopy(head)  # the tied weight's second copy (sync_tied_grads)
            self.lm_head = head

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ):
        """``attention_mask`` (keyword) is the batch's, for stage 0; later stages get the mask
        the previous stage passed on, positionally (schedules may hand every stage of a rank
        the keyword arguments)."""
        from transformers.masking_utils import create_causal_mask

        position_ids = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        hidden = x
        if self.first:
            hidden = self.embed_tokens(x)
            if self.positions is not None:
                hidden = hidden + self.positions(position_ids)
            if self.dropout is not None:
                hidden = self.dropout(hidden)
        mask = attention_mask if self.first else mask
        mask2d = mask if mask is not None and mask.numel() else None
        causal = create_causal_mask(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=mask2d,
            cache=None,
            position_ids=position_ids,
        )
        extra = {}
        if self.rotary_emb is not None:
            extra["position_embeddings"] = self.rotary_emb(hidden, position_ids=position_ids)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=causal, position_ids=position_ids, **extra)
        if self.last:
            return self.lm_head(self.norm(hidden))
        empty = torch.empty(0, device=hidden.device)
        return hidden, (mask2d.contiguous() if mask2d is not None else empty)


def stage_layer_ranges(
    model: nn.Module, pp_size: int, partition: str | Sequence[int] = "parameters"
) -> list[range]:
    """The decoder layers of each of ``pp_size`` stages (the embedding counted on the first,
    the norm and head on the last)."""
    parts = decoder_layout(model)
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in parts.layers]
    embed = parts.embed.weight.numel() + (parts.positions.weight.numel() if parts.positions else 0)
    head = model.lm_head.weight.numel() + sum(p.numel() for p in parts.norm.parameters())
    return partition_layers(sizes, pp_size, partition, first_extra=embed, last_extra=head)


def split_causal_lm(
    model: nn.Module, pp_size: int, pp_rank: int, partition: str | Sequence[int] = "parameters"
) -> CausalLMStage:
    """The stage module rank ``pp_rank`` of ``pp_size`` runs (it shares the model's modules)."""
    bounds = stage_layer_ranges(model, pp_size, partition)
    return CausalLMStage(model, bounds[pp_rank], pp_rank == 0, pp_rank == pp_size - 1)


def stage_model_parameters(
    model: nn.Module, layers: range, first: bool, last: bool
) -> list[nn.Parameter]:
    """The model's own parameters a stage with these layers runs (a tied head: the embedding's
    weight, which the first stage holds), without building the stage."""
    parts = decoder_layout(model)
    modules = [parts.layers[i] for i in layers]
    if first:
        modules += [parts.embed] + ([parts.positions] if parts.positions is not None else [])
    if last:
        modules += [parts.norm, model.lm_head]
    return list(dict.fromkeys(p for m in modules for p in m.parameters()))


def sync_tied_grads(
    stage: CausalLMStage,
    group: dist.ProcessGroup | None,
    all_reduce: Callable[[torch.Tensor], None] | None = None,
) -> None:
    """Sum the tied embedding's gradient over its two copies (first and last stage; ``group``
    holds exactly those two ranks), so both copies take the same, tied update. ``all_reduce``
    replaces ``dist.all_reduce`` over ``group`` (an engine's booked collective)."""
    if not stage.tied or (stage.first and stage.last):
        return  # untied, or one stage sharing the weight already
    weight = stage.embed_tokens.weight if stage.first else stage.lm_head.weight
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    if all_reduce is None:
        dist.all_reduce(weight.grad, group=group)
    else:
        all_reduce(weight.grad)
