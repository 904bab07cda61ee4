"""Ulysses attention: sequence-sharded q/k/v become head-sharded, the model's own attention runs
on the whole sequence for this rank's heads, and the output goes back to sequence-sharded.

Registered in transformers' ``AttentionInterface`` under `NAME`, so any model that dispatches on
``config._attn_implementation`` (Llama, Qwen2/3, Mistral, ...) uses it unchanged. Two
all-to-alls per layer in the forward (q/k/v together, then the output), the same in backward.

Grouped-query attention: with as many kv heads as the sequence-parallel size or more, each rank
takes its share of them (``kv_heads % sp == 0``). With fewer (``sp % kv_heads == 0``), every kv
head is repeated ``sp / kv_heads`` times before the exchange, as DeepSpeed's Ulysses does, so each
rank receives the one kv head its query heads use. Other head counts are refused at start.
"""

from __future__ import annotations

import torch

from hf_zero.comm import Collectives
from hf_zero.comm.topology import Group

NAME = "hf_zero_ulysses"
"""The attention implementation name a sequence-parallel model's config carries."""


def all_to_all(
    x: torch.Tensor, scatter_dim: int, gather_dim: int, group: Group, comm: Collectives
) -> torch.Tensor:
    """Split ``x`` into ``group.size`` pieces along ``scatter_dim``, send piece ``i`` to rank
    ``i`` and join what arrives along ``gather_dim`` (in rank order). Differentiable: the
    backward is the exchange the other way."""
    return _AllToAll.apply(x, scatter_dim, gather_dim, group, comm)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group, comm):
        ctx.dims, ctx.group, ctx.comm = (scatter_dim, gather_dim), group, comm
        return _exchange(x, scatter_dim, gather_dim, group, comm)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _exchange(grad, gather_dim, scatter_dim, ctx.group, ctx.comm), None, None, None, None


def _exchange(x, scatter_dim, gather_dim, group, comm) -> torch.Tensor:
    pieces = torch.stack(x.chunk(group.size, dim=scatter_dim))
    arrived = torch.empty_like(pieces)
    comm.all_to_all(arrived, pieces, group)
    return torch.cat(arrived.unbind(0), dim=gather_dim)


def check_heads(num_heads: int, num_kv_heads: int, sp: int) -> None:
    """Raise ``ValueError`` when Ulysses cannot split these heads over ``sp`` ranks."""
    if num_heads % sp:
        raise ValueError(
            f"zero config: 'sp_size' = {sp} must divide the model's attention heads "
            f"({num_heads}); choose an sp_size that does"
        )
    if num_kv_heads % sp and sp % num_kv_heads:
        raise ValueError(
            f"zero config: 'sp_size' = {sp} and the model's {num_kv_heads} key/value heads: one "
            "must divide the other (kv heads are split, or repeated when fewer than sp_size)"
        )


def _repeat_heads(x: torch.Tensor, times: int) -> torch.Tensor:
    if times == 1:
        return x
    b, heads, s, d = x.shape
    return x[:, :, None].expand(b, heads, times, s, d).reshape(b, heads * times, s, d)


class _GroupsView:
    """The attention module as the inner attention function reads it, with the query heads per
    kv head that hold after the exchange (they differ when kv heads were repeated)."""

    def __init__(self, module: torch.nn.Module, groups: int) -> None:
        self._module, self.num_key_value_groups = module, groups

    def __getattr__(self, name):
        return getattr(self._module, name)


class UlyssesAttention:
    """The registered attention function; `sequence_state` supplies the batch's masks."""

    def __init__(self, inner, inner_name: str, sequence_state) -> None:
        self.inner, self.inner_name, self.state = inner, inner_name, sequence_state

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        state = self.state
        group, comm, sp = state.group, state.comm, state.group.size
        key = _repeat_heads(key, max(1, sp // key.shape[1]))
        value = _repeat_heads(value, max(1, sp // value.shape[1]))
        # [b, heads, s/sp, d] -> [b, heads/sp, s, d]
        query, key, value = (all_to_all(t, 1, 2, group, comm) for t in (query, key, value))
        groups = query.shape[1] // key.shape[1]
        if groups != getattr(module, "num_key_value_groups", groups):
            module = _GroupsView(module, groups)
        # Eager attention adds a float mask and has no causal default; sdpa takes booleans, or
        # None for a plain causal batch (its fused causal kernels).
        additive = query.dtype if self.inner_name == "eager" else None
        # Mistral passes its window as an argument, Qwen2 sets it on each sliding layer
        window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
        mask = state.mask(window, additive)
        out, _ = self.inner(module, query, key, value, mask, **kwargs)
        # [b, s, heads/sp, d] -> [b, s/sp, heads, d]
        return all_to_all(out, 1, 2, group, comm), None


def register(sequence_state, inner_name: str) -> None:
    """Make `NAME` dispatch to Ulysses around ``inner_name`` (``"sdpa"`` or ``"eager"``)."""
    from transformers import AttentionInterface
    from transformers.models.llama.modeling_llama import eager_attention_forward

    if inner_name not in ("sdpa", "eager"):
        raise NotImplementedError(
            f"hf_zero: sequence parallelism runs the model's attention as 'sdpa' or 'eager'; "
            f"attn_implementation {inner_name!r} is not supported yet (its kernels take no "
            "full-sequence mask). Load the model with attn_implementation='sdpa'"
        )
    inner = AttentionInterface._global_mapping.get(inner_name) or eager_attention_forward
    if inner_name == "eager":
        inner = eager_attention_forward
    AttentionInterface.register(NAME, UlyssesAttention(inner, inner_name, sequence_state))
