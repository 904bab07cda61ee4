"""AutoTP: tensor parallelism from a model's own ``tp_plan``, on plain local tensors.

The plan maps module names (``*`` matches one name component, as in transformers) to a style.
It is the merge, later winning, of ``config.base_model_tp_plan`` (prefixed with the base model's
attribute), the class's ``_tp_plan``, the instance's ``_tp_plan``, then the hf_zero config's
``tp_plan`` (regular expressions, full-matched against module names) or a named preset.

Each planned module's weight is replaced by this rank's slice, a plain ``nn.Parameter``, so
ZeRO's flat buffers and hooks see ordinary tensors; Megatron-style autograd functions on the
module's inputs and outputs keep the forward and backward contracts:

==============================  ==================  ============================================
style                           weight split        input / output
==============================  ==================  ============================================
colwise                         dim 0 (out)         input copied (grad all-reduced); output local
colwise_gather_output (_rep)    dim 0               as colwise, output all-gathered
rowwise                         dim 1 (in)          input local; output all-reduced
rowwise_split_input (_rep)      dim 1               input sliced here; output all-reduced
embedding_rowwise               dim 0 (vocab)       ids outside the slice give 0; all-reduced
embedding_colwise               dim 1 (hidden)      output all-gathered
packed_colwise                  dim 0, per half     as colwise (fused gate/up: each half split)
packed_rowwise                  dim 1, per half     as rowwise
replicated_with_grad_allreduce  none                parameter gradients summed over TP ranks
==============================  ==================  ============================================

Everything is validated (styles, module types, divisibility of every split dimension and of
the attention head counts) before any module is touched.
"""

from __future__ import annotations

import logging
import re
import weakref
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hf_zero.comm import Collectives
from hf_zero.comm.topology import Group

logger = logging.getLogger(__name__)

LINEAR_STYLES = {
    "colwise": (0, 1),
    "colwise_gather_output": (0, 1),
    "colwise_rep": (0, 1),
    "rowwise": (1, 1),
    "rowwise_split_input": (1, 1),
    "rowwise_rep": (1, 1),
    "packed_colwise": (0, 2),
    "packed_rowwise": (1, 2),
}
"""style -> (weight dimension split across ranks, packed parts along it)"""
EMBEDDING_STYLES = {"embedding_rowwise": (0, 1), "embedding_colwise": (1, 1)}
REPLICATED = "replicated_with_grad_allreduce"
STYLES = sorted({*LINEAR_STYLES, *EMBEDDING_STYLES, REPLICATED})

PRESETS: dict[str, dict[str, str]] = {
    # For Llama-style decoders whose class carries no plan (regexes over module names).
    "llama": {
        r"(.*\.)?(q_proj|k_proj|v_proj|gate_proj|up_proj)": "colwise",
        r"(.*\.)?(o_proj|down_proj)": "rowwise",
        r"(.*\.)?embed_tokens": "embedding_rowwise",
        r"lm_head": "colwise_gather_output",
    },
}
HEAD_COUNTS = ("num_attention_heads", "num_key_value_heads")
HEAD_ATTRIBUTES = ("num_heads", "num_attention_heads", "num_key_value_heads")


@dataclass(frozen=True)
class TPShard:
    """How one parameter was split: along ``dim``, in ``parts`` packed blocks."""

    dim: int
    parts: int


# --- plans --------------------------------------------------------------------------------------
def model_tp_plan(model: torch.nn.Module) -> dict[str, str]:
    """The plan the model declares: config, class, then instance (later entries win)."""
    plan: dict[str, str] = {}
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    config_plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
    for pattern, style in config_plan.items():
        plan[f"{prefix}.{pattern}" if isinstance(base, torch.nn.Module) else pattern] = style
    plan.update(getattr(type(model), "_tp_plan", None) or {})
    plan.update(vars(model).get("_tp_plan") or {})
    return plan


def resolve_plan(
    model: torch.nn.Module, extra: Mapping[str, str] | str | None = None
) -> dict[str, str]:
    """Module name -> style for every module the plan names.

    ``extra`` (the config's ``tp_plan``) is a mapping of regular expressions to styles or a
    preset name from `PRESETS`; it wins over the model's own plan.
    """
    if isinstance(extra, str):
        if extra not in PRESETS:
            raise ValueError(
                f"zero config: 'tp_plan' = {extra!r} is not a preset; allowed: {sorted(PRESETS)}"
                " or a mapping of module-name regexes to styles"
            )
        extra = PRESETS[extra]
    globs = [(_glob_regex(p), s) for p, s in model_tp_plan(model).items()]
    regexes = [(re.compile(p), s) for p, s in (extra or {}).items()]
    resolved = {}
    for name, _ in model.named_modules():
        style = None
        for pattern, candidate in globs + regexes:  # later wins
            if pattern.fullmatch(name):
                style = candidate
        if style is not None:
            resolved[name] = style
    return resolved


def _glob_regex(pattern: str) -> re.Pattern:
    return re.compile(r"[^.]+".join(re.escape(part) for part in pattern.split("*")))


# --- autograd collectives ------------------------------------------------------------------------
# Each takes the `Collectives` (purpose "tp") of its `TensorParallel`, so TP traffic is booked.
class _CopyToTP(torch.autograd.Function):
    """Identity forward; backward sums the input gradient over the TP group."""

    @staticmethod
    def forward(ctx, x, group, comm):
        ctx.group, ctx.comm = group, comm
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        ctx.comm.all_reduce(grad, ctx.group)
        return grad, None, None


class _ReduceFromTP(torch.autograd.Function):
    """Forward sums partial results over the TP group; identity backward."""

    @staticmethod
    def forward(ctx, x, group, comm):
        x = x.contiguous().clone()
        comm.all_reduce(x, group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def _gather_last_dim(x: torch.Tensor, group: Group, comm: Collectives) -> torch.Tensor:
    """Every rank's ``x`` concatenated along the last dimension, in rank order."""
    stacked = torch.empty((group.size, *x.shape), dtype=x.dtype, device=x.device)
    comm.all_gather(stacked.view(-1), x.contiguous().view(-1), group)
    return torch.cat(stacked.unbind(0), dim=-1)


class _GatherFromTP(torch.autograd.Function):
    """Forward concatenates every rank's last-dimension slice; backward keeps this rank's."""

    @staticmethod
    def forward(ctx, x, group, index, comm):
        ctx.index, ctx.size = index, x.shape[-1]
        return _gather_last_dim(x, group, comm)

    @staticmethod
    def backward(ctx, grad):
        start = ctx.index * ctx.size
        return grad[..., start : start + ctx.size].contiguous(), None, None, None


class _SplitToTP(torch.autograd.Function):
    """Forward keeps this rank's last-dimension slice; backward gathers the full gradient."""

    @staticmethod
    def forward(ctx, x, group, index, comm):
        ctx.group, ctx.index, ctx.comm = group, index, comm
        size = x.shape[-1] // group.size
        return x[..., index * size : (index + 1) * size].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _GatherFromTP.apply(grad, ctx.group, ctx.index, ctx.comm), None, None, None


# --- sharding -------------------------------------------------------------------------------------
def split(tensor: torch.Tensor, shard: TPShard, index: int, size: int) -> torch.Tensor:
    """This rank's slice of ``tensor`` (each packed part split on its own)."""
    dim = shard.dim if tensor.dim() > 1 else 0
    parts = tensor.chunk(shard.parts, dim=dim)
    return torch.cat([p.chunk(size, dim=dim)[index] for p in parts], dim=dim).contiguous()


def unsplit(pieces: list[torch.Tensor], shard: TPShard) -> torch.Tensor:
    """The full tensor from every rank's slice, in rank order (inverse of `split`)."""
    dim = shard.dim if pieces[0].dim() > 1 else 0
    per_rank = [p.chunk(shard.parts, dim=dim) for p in pieces]
    return torch.cat(
        [torch.cat([r[k] for r in per_rank], dim=dim) for k in range(shard.parts)], dim=dim
    )


def gather_full(
    local: torch.Tensor, shard: TPShard, group: Group, comm: Collectives
) -> torch.Tensor:
    """Collective over the TP group: the whole parameter from every rank's slice."""
    stacked = torch.empty((group.size, *local.shape), dtype=local.dtype, device=local.device)
    comm.all_gather(stacked.view(-1), local.contiguous().view(-1), group)
    return unsplit(list(stacked.unbind(0)), shard)


class TensorParallel:
    """Applies a resolved plan to a model on one TP group and remembers what it split.

    Its collectives go through ``comm`` booked as purpose ``"tp"`` (the engine passes its own;
    without one, a private `Collectives` counts them in ``self.comm.stats``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        plan: Mapping[str, str],
        group: Group,
        comm: Collectives | None = None,
    ) -> None:
        self.model = model
        self.plan = dict(plan)
        self.group = group
        self.comm = (comm or Collectives()).for_purpose("tp")
        self.size = group.size
        self.index = group.rank_of(dist.get_rank())
        self.shards: dict[int, TPShard] = {}
        """id(parameter) -> how it was split."""
        self.replaced: dict[int, tuple[weakref.ref, torch.nn.Parameter]] = {}
        """id(original parameter) -> (the original, weakly; the local parameter that took its
        place). Read it through `local_of`: an original no longer used is freed, and a new
        object may then get its id."""
        self._handles = []

    # --- validation (touches nothing) ---------------------------------------------------------
    def validate(self) -> None:
        modules = dict(self.model.named_modules())
        config = getattr(self.model, "config", None)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        for name, style in self.plan.items():
            module = modules[name]
            if style not in STYLES:
                raise ValueError(
                    f"hf_zero AutoTP: module '{name}' has tp_plan style {style!r}, which hf_zero "
                    f"does not support; supported: {', '.join(STYLES)}"
                )
            if style in LINEAR_STYLES and not isinstance(module, torch.nn.Linear):
                raise ValueError(
                    f"hf_zero AutoTP: style {style!r} on '{name}' needs an nn.Linear, got "
                    f"{type(module).__name__}"
                )
            if style in EMBEDDING_STYLES and not isinstance(module, torch.nn.Embedding):
                raise ValueError(
                    f"hf_zero AutoTP: style {style!r} on '{name}' needs an nn.Embedding, got "
                    f"{type(module).__name__}"
                )
        attention_split = any(
            LINEAR_STYLES.get(s, (None,))[0] == 0 and "attn" in n for n, s in self.plan.items()
        )
        for field in HEAD_COUNTS if attention_split else ():
            count = getattr(text, field, None)
            if isinstance(count, int) and count % self.size:
                raise ValueError(
                    f"hf_zero AutoTP: tp_size = {self.size} does not divide the model's "
                    f"'{field}' = {count}: attention is split by heads"
                )
        for name, style in self.plan.items():
            shard = self._shard_of(style)
            if shard is None:
                continue
            weight = modules[name].weight
            length = weight.shape[shard.dim] // shard.parts
            if weight.shape[shard.dim] % shard.parts or length % self.size:
                what = _config_field_of(text, weight.shape[shard.dim])
                raise ValueError(
                    f"hf_zero AutoTP: tp_size = {self.size} does not divide dimension "
                    f"{shard.dim} ({weight.shape[shard.dim]}{what}) of '{name}.weight' "
                    f"(style {style!r}, {shard.parts} packed part(s))"
                )
        self._check_ties(modules)

    def _check_ties(self, modules: dict[str, torch.nn.Module]) -> None:
        """A weight shared by two modules must be split the same way for both."""
        seen: dict[int, tuple[str, TPShard | None]] = {}
        for name, module in modules.items():
            weight = getattr(module, "weight", None)
            if not isinstance(weight, torch.nn.Parameter):
                continue
            style = self.plan.get(name)
            shard = self._shard_of(style) if style else None
            if id(weight) in seen:
                other, other_shard = seen[id(weight)]
                if (shard or other_shard) and shard != other_shard:
                    raise ValueError(
                        f"hf_zero AutoTP: '{name}.weight' is tied to '{other}.weight' but the "
                        f"plan splits them differently ({shard} vs {other_shard}); give both "
                        "matching styles (e.g. embedding_rowwise with colwise_gather_output)"
                    )
            else:
                seen[id(weight)] = (name, shard)

    @staticmethod
    def _shard_of(style: str) -> TPShard | None:
        dim_parts = LINEAR_STYLES.get(style) or EMBEDDING_STYLES.get(style)
        return TPShard(*dim_parts) if dim_parts else None

    # --- application --------------------------------------------------------------------------
    def apply(self) -> None:
        """Validate, then shard every planned module and install its hooks."""
        self.validate()
        modules = dict(self.model.named_modules())
        replaced = self.replaced
        for name, style in self.plan.items():
            module = modules[name]
            shard = self._shard_of(style)
            if shard is None:  # replicated_with_grad_allreduce
                for p in module.parameters(recurse=False):
                    self._handles.append(p.register_hook(self._sum_grad))
                continue
            for attr in ("weight", "bias"):
                p = getattr(module, attr, None)
                if p is None or (attr == "bias" and shard.dim == 1):
                    continue  # a rowwise bias stays whole: it is added once, after the reduce
                local = self.local_of(p)
                if local is p:
                    local = torch.nn.Parameter(
                        split(p.data, shard, self.index, self.size), requires_grad=p.requires_grad
                    )
                    self.shards[id(local)] = shard
                    replaced[id(p)] = (weakref.ref(p), local)
                setattr(module, attr, local)
            self._install(module, style)
        # Tied weights: every other module holding an old parameter gets the new one.
        for module in self.model.modules():
            for attr, p in list(module._parameters.items()):
                if p is not None:
                    module._parameters[attr] = self.local_of(p)
        self._divide_head_counts()
        logger.info("hf_zero AutoTP: %d modules split over %d ranks", len(self.plan), self.size)

    def _install(self, module: torch.nn.Module, style: str) -> None:
        group, index, comm = self.group, self.index, self.comm
        pre, post = None, None
        if style.startswith("colwise") or style == "packed_colwise":

            def pre(m, args):
                return (_CopyToTP.apply(args[0], group, comm), *args[1:])

            if style in ("colwise_gather_output", "colwise_rep"):

                def post(m, args, out):
                    return _GatherFromTP.apply(out, group, index, comm)

        elif style.startswith("rowwise") or style == "packed_rowwise":
            if style in ("rowwise_split_input", "rowwise_rep"):

                def pre(m, args):
                    return (_SplitToTP.apply(args[0], group, index, comm), *args[1:])

            def post(m, args, out):
                if m.bias is None:
                    return _ReduceFromTP.apply(out, group, comm)
                # The local matmul added the whole bias on every rank: add it once instead.
                return _ReduceFromTP.apply(out - m.bias, group, comm) + m.bias

        elif style == "embedding_rowwise":
            rows = module.weight.shape[0]
            start = index * rows
            if module.padding_idx is not None:
                local = module.padding_idx - start
                module.padding_idx = local if 0 <= local < rows else None

            def pre(m, args):
                ids = args[0] - start
                m._hf_zero_outside = (ids < 0) | (ids >= rows)
                return (ids.masked_fill(m._hf_zero_outside, 0), *args[1:])

            def post(m, args, out):
                out = out.masked_fill(m._hf_zero_outside.unsqueeze(-1), 0.0)
                del m._hf_zero_outside
                return _ReduceFromTP.apply(out, group, comm)

        elif style == "embedding_colwise":

            def post(m, args, out):
                return _GatherFromTP.apply(out, group, index, comm)

        if pre is not None:
            self._handles.append(module.register_forward_pre_hook(pre))
        if post is not None:
            self._handles.append(module.register_forward_hook(post))

    def _sum_grad(self, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        self.comm.all_reduce(grad, self.group)
        return grad

    def _divide_head_counts(self) -> None:
        """Attention modules that count their heads now hold ``1/tp`` of them."""
        split_parents = {n.rpartition(".")[0] for n, s in self.plan.items() if s in LINEAR_STYLES}
        for name, module in self.model.named_modules():
            if name not in split_parents:
                continue
            for attr in HEAD_ATTRIBUTES:
                value = vars(module).get(attr)
                if isinstance(value, int) and value % self.size == 0:
                    setattr(module, attr, value // self.size)

    def local_of(self, param: torch.Tensor) -> torch.Tensor:
        """The local parameter that took ``param``'s place, or ``param`` itself."""
        entry = self.replaced.get(id(param))
        return entry[1] if entry is not None and entry[0]() is param else param

    # --- saving -------------------------------------------------------------------------------
    def shard_of(self, param: torch.Tensor) -> TPShard | None:
        return self.shards.get(id(param))

    def gather_full(self, local: torch.Tensor, shard: TPShard) -> torch.Tensor:
        """Collective over the TP group: the whole parameter from every rank's slice."""
        return gather_full(local, shard, self.group, self.comm)

    def describe(self) -> dict:
        """What a checkpoint records about the layout."""
        return {"tp_size": self.size, "plan": dict(sorted(self.plan.items()))}


def _config_field_of(config, value: int) -> str:
    for field in ("hidden_size", "intermediate_size", "vocab_size", "num_attention_heads"):
        if getattr(config, field, None) == value:
            return f" = the model's '{field}'"
    return ""
