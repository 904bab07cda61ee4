"""The user's optimizer, re-pointed at fp32 master-weight shards, and the step around it.

At every stage (0-3) each rank holds one flat master shard per bucket (at stage 0 the shard is the
whole bucket; at stage 3 the parameter shard and the master cover the same elements), in fp32
unless 16-bit storage is asked for, wherever the master-weight kind keeps it. Because the update
rule of the supported optimizers is elementwise, running the user's own optimizer object on those
flat shards computes exactly what it would compute on whole parameters. The optimizer object is
kept (its ``param_groups`` are re-pointed in place), so hyperparameters, per-group learning rates
and any LR scheduler attached to it keep working.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict

import torch

from hf_zero.comm import Collectives
from hf_zero.comm.topology import Group
from hf_zero.numerics.precision import LossScaler
from hf_zero.observe import clock
from hf_zero.optim.master_step import BucketHostStep, HostStep, master_step
from hf_zero.sharding.flat_group import FlatParamGroup

logger = logging.getLogger(__name__)

# Optimizers whose update of each element depends only on that element's own state.
ELEMENTWISE_OPTIMIZERS = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.Adamax,
    torch.optim.Adadelta,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Rprop,
    torch.optim.ASGD,
)
# Known to couple elements (per-tensor norms, factored or matrix statistics, closures).
NON_ELEMENTWISE_NAMES = {
    "LBFGS",
    "SparseAdam",
    "Adafactor",
    "Lamb",
    "LAMB",
    "FusedLamb",
    "OnebitLamb",
    "Lars",
    "LARS",
    "Shampoo",
    "DistributedShampoo",
    "Muon",
    "GaLoreAdamW",
}


def _bnb_optim_bits(optimizer: torch.optim.Optimizer) -> int:
    """The state precision of a bitsandbytes optimizer (32 or 8), from its argument record."""
    args = getattr(optimizer, "args", None)
    return getattr(args, "optim_bits", 32) if args is not None else 32


def check_elementwise(optimizer: torch.optim.Optimizer, allow_untested: bool) -> None:
    """Raise ``ValueError`` unless ``optimizer``'s update is known to be elementwise."""
    cls = type(optimizer)
    names = {c.__name__ for c in cls.__mro__}
    if "Optimizer8bit" in names and _bnb_optim_bits(optimizer) == 8:
        raise ValueError(
            f"hf_zero: optimizer {cls.__name__} (bitsandbytes, 8-bit state) is not supported: it "
            "quantizes its state in blocks with one absmax per block over each tensor it is "
            "given, and keeps tensors under 'min_8bit_size' in 32 bits, so on flat ZeRO shards "
            "its blocks, thresholds and state layout differ from the unsharded step, and the "
            "per-block scales cannot be resharded on resume. LoRA adapters' optimizer state is "
            "small: use torch.optim.AdamW (or bitsandbytes' 32-bit AdamW with "
            "'allow_untested_optimizer': true)."
        )
    if names & NON_ELEMENTWISE_NAMES:
        raise ValueError(
            f"hf_zero: optimizer {cls.__name__} is not elementwise (its update mixes elements of a "
            "tensor through norms, factored or matrix statistics), so it cannot run on flat "
            "ZeRO shards. Use an elementwise optimizer such as torch.optim.AdamW, or stage 0."
        )
    if not isinstance(optimizer, ELEMENTWISE_OPTIMIZERS) and not allow_untested:
        known = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
        raise ValueError(
            f"hf_zero: optimizer {cls.__module__}.{cls.__name__} has not been verified to be "
            f"elementwise. Verified: {known}. If its update is elementwise, set "
            "'allow_untested_optimizer': true (DeepSpeed: 'zero_allow_untested_optimizer')."
        )


def shard_optimizer_state(state: dict, groups: list[FlatParamGroup]) -> defaultdict:
    """Re-key per-parameter optimizer state onto each group's flat master shard.

    Tensors shaped like their parameter are laid out like the parameters (padding zero) and cut
    to this rank's shard, in fp32; scalars (step counters) must agree across a bucket's members.
    """
    sharded: defaultdict = defaultdict(dict)
    if not state:
        return sharded
    for group in groups:
        entries = [state.get(p, {}) for p in group.params]
        keys = set().union(*entries)
        if keys and not all(set(e) == keys for e in entries):
            raise ValueError(
                f"hf_zero: optimizer state exists for only some parameters of bucket "
                f"{group.index}; pass a freshly built optimizer or state for every parameter"
            )
        start, end = group.layout.shard_range(group.shard_index)
        for key in keys:
            values = [e[key] for e in entries]
            first = values[0]
            if torch.is_tensor(first) and all(
                torch.is_tensor(v) and v.shape == p.shape for v, p in zip(values, group.params)
            ):
                flat = torch.zeros(group.layout.padded_numel, device=group.master.device)
                for slot, v in zip(group.layout.slots, values):
                    flat[slot.offset : slot.end].copy_(v.reshape(-1))
                sharded[group.master][key] = flat[start:end].clone()
            elif all(_same_scalar(v, first) for v in values):
                sharded[group.master][key] = first.clone() if torch.is_tensor(first) else first
            else:
                raise ValueError(
                    f"hf_zero: cannot shard optimizer state '{key}': it is neither shaped like "
                    "its parameter nor the same scalar for every parameter"
                )
    return sharded


def _same_scalar(value, reference) -> bool:
    if torch.is_tensor(value) or torch.is_tensor(reference):
        ok = torch.is_tensor(value) and torch.is_tensor(reference)
        return ok and value.numel() == 1 and reference.numel() == 1 and bool(value == reference)
    return value == reference


class ShardedOptimizer:
    """Steps the user's optimizer on fp32 master shards: unscale, clip, step, gather back."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        groups: list[FlatParamGroup],
        comm: Collectives,
        dp_group: Group,
        loss_scaler: LossScaler,
        tp_group: Group | None = None,
        fast_kernel: bool = True,
        buffer_count: int = 4,
        pp_group: Group | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.tp_group = tp_group
        self.pp_group = pp_group
        """Pipelines: the stages of this rank's pipeline, whose norms add up to the model's."""
        self.groups = groups
        self.comm = comm.for_purpose("control")  # overflow flags and norms only
        self.dp_group = dp_group
        self.loss_scaler = loss_scaler
        self.master_step = master_step(optimizer, groups, fast_kernel, buffer_count)
        """The step for where the masters live (device, host, swap files), chosen once."""
        fused = all(g.get("fused") for g in optimizer.param_groups)
        if self.fast_kernel and not fused and dp_group.rank_of(torch.distributed.get_rank()) == 0:
            # Visible, because the numbers change in the last bits (with fused=True, the user's
            # own choice and transformers' default, they do not: nothing to say).
            logger.warning(
                "hf_zero: offloaded %s steps run torch's fused CPU Adam kernel instead of its "
                "for-loop/foreach one (same formula, last-bit rounding differs); set "
                "'offload_optimizer_fast_kernel': false to run your optimizer's own step()",
                type(optimizer).__name__,
            )
        self.last_grad_norm: float | None = None
        """Global gradient norm before clipping, from the last clip (None if not computed)."""
        self.last_grad_norm_post_clip: float | None = None
        self._grads_prepared = False
        self._overflow = False
        # Some optimizers (Adagrad) create state in __init__, and a user may have loaded state:
        # re-key it onto the master shards rather than orphan it.
        optimizer.state = shard_optimizer_state(optimizer.state, groups)
        for g in groups:
            g.master_weights.adopt_state(optimizer)
        for index, param_group in enumerate(optimizer.param_groups):
            param_group["params"] = [g.master for g in groups if g.param_group_index == index]

    @property
    def offload(self) -> bool:
        """The masters and the step are off the device (ZeRO-Offload, ZeRO-Infinity)."""
        return self.master_step.offload

    @property
    def fast_kernel(self) -> bool:
        """Offload: the user's Adam/AdamW is stepped by torch's fused CPU kernel instead."""
        return self.master_step.fast_kernel

    @property
    def overlap_copy_back(self) -> bool:
        """Offload: each updated tile is copied to the device while the CPU updates the next."""
        return getattr(self.master_step, "overlap_copy_back", False)

    @overlap_copy_back.setter
    def overlap_copy_back(self, on: bool) -> None:
        if not isinstance(self.master_step, (HostStep, BucketHostStep)):
            raise ValueError("hf_zero: overlap_copy_back applies to offload_optimizer: cpu only")
        self.master_step.overlap_copy_back = on

    # --- per-step gradient preparation -------------------------------------------------------
    def prepare_grads(self) -> bool:
        """Check fp16 overflow on every rank and unscale; True if the step must be skipped."""
        if self._grads_prepared:
            return self._overflow
        self._grads_prepared = True
        for group in self.groups:
            group.grads.settle()
        grads = [g.grads for g in self.groups if g.grads.present]
        if self.loss_scaler.enabled:
            local = any(not g.all_finite() for g in grads)
            flag = torch.tensor([1.0 if local else 0.0], device=self._comm_device())
            self.comm.all_reduce_max(flag, self.dp_group)
            if self.tp_group is not None:
                self.comm.all_reduce_max(flag, self.tp_group)
            if self.pp_group is not None:  # every stage skips the step together
                self.comm.all_reduce_max(flag, self.pp_group)
            self._overflow = bool(flag.item())
            if not self._overflow:
                inv = 1.0 / self.loss_scaler.scale
                for g in grads:
                    g.scale_(inv)  # deferred to the step's conversion while 16-bit
        return self._overflow

    def global_grad_norm(self) -> float:
        """L2 norm of the whole (unscaled) gradient across all shards (collective); with
        pipeline stages, across every stage. Groups not ``counted_in_norm`` are left out."""
        self.prepare_grads()
        # With TP: [replicated, TP-split]; a TP-split parameter's norm sums over its TP slices.
        tp = self.tp_group is not None
        sq = torch.zeros(2 if tp else 1, dtype=torch.float32, device=self._master_device())
        # `.to(sq.device)`: under partial offload some gradients are on the host.
        for g in self.groups:
            if g.grads.present and g.counted_in_norm:
                sq[int(g.tp_split and tp)] += g.grads.square_sum().to(sq.device)
        sq = sq.to(self._comm_device())
        if self.groups and self.groups[0].layout.num_shards > 1:
            self.comm.all_reduce(sq, self.dp_group)
        if tp:
            split = sq[1:].clone()
            self.comm.all_reduce(split, self.tp_group)
            sq[1:] = split
        if self.pp_group is not None:
            self.comm.all_reduce(sq, self.pp_group)
        return math.sqrt(sq.sum().item())

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip the global gradient norm to ``max_norm``; returns the norm before clipping."""
        norm = self.global_grad_norm()
        self.last_grad_norm = norm
        if self._overflow or not math.isfinite(norm):
            self.last_grad_norm_post_clip = norm
            return norm
        # Same rule as torch.nn.utils.clip_grad_norm_.
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for g in self.groups:
                g.grads.scale_(coef)
        self.last_grad_norm_post_clip = norm * min(coef, 1.0)
        return norm

    # --- the step ----------------------------------------------------------------------------
    def step(self, gradient_clipping: float = 0.0, clipped: bool = False) -> bool:
        """One optimizer step on the master shards, then all-gather. False if skipped (fp16)."""
        overflow = self.prepare_grads()
        self.loss_scaler.update(overflow)
        if overflow:
            return False
        if gradient_clipping > 0 and not clipped:
            self.clip_grad_norm_(gradient_clipping)
        clock.mark("optimizer step")
        with clock.phase("optimizer"):
            self.master_step()
        clock.mark("optimizer step: master weights updated")
        works = [g.refresh_params(async_op=True) for g in self.groups]
        for work in works:
            if work is not None:
                work.wait()
        for group in self.groups:
            group.release_staged()
        return True

    def end_step(self) -> None:
        self._grads_prepared = False
        self._overflow = False

    def state_of(self, group: FlatParamGroup) -> dict:
        """The optimizer state of ``group``'s master shard (read from disk under NVMe)."""
        return group.master_weights.optimizer_state(self.optimizer)

    def state_spec(self, group: FlatParamGroup) -> dict[str, tuple[torch.dtype, tuple]]:
        """Dtype and shape of each state tensor of ``group``, without reading them."""
        return group.master_weights.state_spec(self.optimizer)

    def load_state_of(self, group: FlatParamGroup, master: torch.Tensor, state: dict) -> None:
        """Replace ``group``'s fp32 master shard and optimizer state (a loaded checkpoint)."""
        group.master_weights.load(master, state, self.optimizer, group.placement)

    def state_bytes(self) -> dict[str, int]:
        """Bytes of optimizer state tensors (momenta, variances, step counters), by where they
        live: ``optimizer_states`` beside device masters, ``host_optimizer_states`` beside
        masters in host memory (offload; swap files count their own)."""
        host = {id(g.master) for g in self.groups if g.master_weights.location != "device"}
        total = {"optimizer_states": 0, "host_optimizer_states": 0}
        for param, state in self.optimizer.state.items():
            where = "host_optimizer_states" if id(param) in host else "optimizer_states"
            for value in state.values():
                if torch.is_tensor(value):
                    total[where] += value.numel() * value.element_size()
        return total

    def _master_device(self) -> torch.device:
        return self.groups[0].master.device if self.groups else torch.device("cpu")

    def _comm_device(self) -> torch.device:
        return self.groups[0].device if self.groups else torch.device("cpu")
