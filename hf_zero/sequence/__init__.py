"""Mechanisms for the activations of long sequences, installed on a causal LM.

* Ulysses sequence parallelism (``sp_size`` > 1): each rank of a sequence-parallel group holds
  1/sp of every sequence (`shards`); attention exchanges q/k/v for heads and back (`ulysses`),
  with the whole sequence's masks (`masks`).
* Tiled logits (``tiled_logits``): the head and cross-entropy a tile of tokens at a time, so the
  whole logits tensor never exists (`tiles`).
* Tiled MLP (``tiled_mlp``): every ``*.mlp`` module over tiles of the sequence (`tiles`).
* Checkpoint offload (``offload_checkpoints``): checkpointed layers' saved inputs on the host
  (`offload`).

`install` wraps the causal LM's ``forward`` in place (under PEFT: the base model's), so the
user's collator, data loader, loop and Trainer stay as they are.
"""

from __future__ import annotations

import inspect

import torch

from hf_zero.comm import Collectives
from hf_zero.comm.topology import Topology
from hf_zero.config.zero_config import ZeroConfig
from hf_zero.sequence import tiles, ulysses
from hf_zero.sequence.offload import offload_checkpoints
from hf_zero.sequence.shards import IGNORE, SequenceShards, gather_sequence, sum_over_group

SCALED_LOGITS = ("final_logit_softcapping", "logit_scale", "logits_scaling")
"""Config attributes of models whose head output is changed before the loss (tiling skips the
model's own forward, so it refuses them)."""
AUTO_TILE_LOGITS_BYTES = 256 << 20
"""With ``tiled_logits: auto``, batches whose fp32 logits would exceed this are tiled."""


def causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The model whose ``forward`` computes logits and loss (under PEFT, the base model)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not (hasattr(base, "get_decoder") and hasattr(base, "get_output_embeddings")):
        raise ValueError(
            f"zero config: sequence parallelism and tiled logits need a causal LM with a decoder "
            f"and an output embedding (transformers' *ForCausalLM); got {type(base).__name__}"
        )
    return base


def install(
    model: torch.nn.Module, config: ZeroConfig, topology: Topology, comm: Collectives
) -> CausalLMForward | None:
    """Wrap the causal LM's forward with the configured mechanisms; None when none applies.
    ``tiled_logits: auto`` alone applies to causal LMs whose logits at their longest context
    would exceed `AUTO_TILE_LOGITS_BYTES` for one sequence (it then decides per batch)."""
    explicit = config.sp_size > 1 or config.tiled_logits is True or config.tiled_mlp
    explicit = explicit or config.offload_checkpoints
    if not explicit:
        try:
            base = causal_lm(model)
        except ValueError:
            return None
        longest = getattr(base.config, "max_position_embeddings", 0) or 0
        vocab = getattr(base.config, "vocab_size", 0) or 0
        if config.tiled_logits is False or 4 * vocab * longest <= AUTO_TILE_LOGITS_BYTES:
            return None
    base = causal_lm(model)
    model_config = base.config
    shards = None
    if config.sp_size > 1:
        heads = model_config.num_attention_heads
        ulysses.check_heads(
            heads, getattr(model_config, "num_key_value_heads", heads), config.sp_size
        )
        shards = SequenceShards(topology.sp, comm.for_purpose("sp"), model_config.pad_token_id)
        ulysses.register(shards, model_config._attn_implementation or "sdpa")
        model_config._attn_implementation = ulysses.NAME
    if config.tiled_logits is True:
        for name in SCALED_LOGITS:
            if getattr(model_config, name, None) not in (None, 1, 1.0):
                raise ValueError(
                    f"zero config: 'tiled_logits' = true: this model's '{name}' changes its "
                    "logits before the loss, which tiling would skip; set tiled_logits: false"
                )
    if config.tiled_mlp:
        size = (
            model_config.hidden_size if config.mlp_tile_tokens == "auto" else config.mlp_tile_tokens
        )
        for name, module in base.named_modules():
            if name.split(".")[-1] == "mlp":
                module.forward = tiles.TiledMLP(module.forward, size)
    offloaded = offload_checkpoints(base) if config.offload_checkpoints else 0
    forward = CausalLMForward(base, shards, config.tiled_logits, config.logits_tile_tokens)
    forward.tiled_mlp, forward.offloaded = config.tiled_mlp, offloaded
    base.forward = forward
    return forward


class CausalLMForward:
    """A causal LM's forward with this run's sequence mechanisms around it."""

    def __init__(
        self, model, shards: SequenceShards | None, tiled: bool | str, tile_tokens
    ) -> None:
        self.model, self.original, self.shards = model, model.forward, shards
        self.tiled = tiled
        self.tile_tokens = tiles.logits_tile_tokens(tile_tokens, model.config.vocab_size)
        self._names = list(inspect.signature(self.original).parameters)
        self.__signature__ = inspect.signature(self.original)

    def __call__(self, *args, **kwargs):
        kwargs.update(zip(self._names, args))
        fused = bool(kwargs.get("fused_lm_head"))
        if self.shards is not None:
            kwargs = self.shards.split(kwargs, self._cached(kwargs))
        out = self._tiled_forward(kwargs) if self._tile(kwargs) else self.original(**kwargs)
        if self.shards is not None and getattr(out, "loss", None) is not None:
            out.loss = sum_over_group(out.loss, self.shards.group, self.shards.comm)
        if self.shards is not None and (fused or not torch.is_grad_enabled()):
            self._join_per_token(out, kwargs["position_ids"])
        return out

    def _join_per_token(self, out, positions: torch.Tensor) -> None:
        """Each per-token output joined over the group (the whole sequence on every rank).
        TRL's fused LM head returns per-token log-probabilities (and metrics) that its trainer
        sums into the loss itself, outside the model: joined, that sum is the whole sequence's,
        with the gradient `gather_sequence` gives back. Without gradients (evaluation) the
        logits are joined too, for the metrics computed from them; a training forward keeps
        its slice (the whole logits on every rank are what SP is there to avoid)."""
        shape, shards = positions.shape[:2], self.shards
        for name, value in list(out.items()):
            if name != "loss" and torch.is_tensor(value) and value.shape[:2] == shape:
                out[name] = gather_sequence(value, shards.group, shards.comm, shards.length)

    def describe(self) -> list[str]:
        """What is on, for the engine's start line."""
        parts = [f"Ulysses sequence parallel {self.shards.group.size}"] if self.shards else []
        if self.tiled is not False:
            parts += [f"tiled logits ({self.tiled}, {self.tile_tokens} tokens per tile)"]
        parts += ["tiled MLP"] if self.tiled_mlp else []
        return parts + ([f"{self.offloaded} checkpoints to host"] if self.offloaded else [])

    def _cached(self, kwargs: dict) -> bool:
        """Whether the model, unsharded, would hold a KV cache in this call (transformers then
        does not keep packed sequences apart). Training under activation checkpointing makes
        none."""
        if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
            return True
        use_cache = kwargs.get("use_cache")
        use_cache = self.model.config.use_cache if use_cache is None else use_cache
        model = self.model
        checkpointed = getattr(model, "is_activation_checkpointing", None)
        if checkpointed is None:
            checkpointed = getattr(model, "is_gradient_checkpointing", False)
        return bool(use_cache) and not (checkpointed and model.training and torch.is_grad_enabled())

    def _tile(self, kwargs: dict) -> bool:
        # Only a training forward keeps logits for backward; evaluation keeps its logits (the
        # Trainer's metrics read them), and TRL's fused LM head tiles its own.
        if self.tiled is False or kwargs.get("labels") is None or kwargs.get("fused_lm_head"):
            return False
        if not torch.is_grad_enabled():
            return False
        if self.tiled is True:
            return True
        tokens = kwargs.get("input_ids")
        tokens = tokens if tokens is not None else kwargs["inputs_embeds"]
        if any(getattr(self.model.config, n, None) not in (None, 1, 1.0) for n in SCALED_LOGITS):
            return False
        return (
            tokens.shape[0] * tokens.shape[1] * self.model.config.vocab_size * 4
            > AUTO_TILE_LOGITS_BYTES
        )

    def _tiled_forward(self, kwargs: dict):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        labels, shift = kwargs.pop("labels"), kwargs.pop("shift_labels", None)
        num_items = kwargs.pop("num_items_in_batch", None)
        kwargs.pop("logits_to_keep", None)
        if shift is None:
            shift = torch.nn.functional.pad(labels, (0, 1), value=IGNORE)[:, 1:]
        out = self.model.get_decoder()(**kwargs)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        head = self.model.get_output_embeddings()
        loss = tiles.tiled_loss(hidden, head, shift, num_items, self.tile_tokens)
        return CausalLMOutputWithPast(
            loss=loss, logits=None, hidden_states=getattr(out, "hidden_states", None),
            attentions=getattr(out, "attentions", None),
        )  # fmt: skip
