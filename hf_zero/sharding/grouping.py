"""From a model and its optimizer to `FlatParamGroup` buckets (stages 0-2) or units (stage 3).

The policy in one place: which parameters share a bucket (same optimizer param group, same
TP-split status, in reverse registration order, up to ``reduce_bucket_size`` elements), which
stay whole on every rank (stage 3 below ``param_persistence_threshold``), the order reductions
launch in, and the ZeRO++ settings the groups are built with.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import replace

import torch

from hf_zero.comm import Collectives, ZeroPPSettings
from hf_zero.comm.topology import Topology
from hf_zero.config.zero_config import ZeroConfig
from hf_zero.numerics.packed import is_int8_linear, is_packed, prepare_int8_module
from hf_zero.numerics.precision import dtype_of
from hf_zero.sharding.flat_group import FlatParamGroup
from hf_zero.sharding.group_spec import GroupSpec
from hf_zero.sharding.layout import bucket_params
from hf_zero.sharding.stage3.partitioned_init import unshard
from hf_zero.sharding.stage3.partitioned_load import slice_of, unshard_params
from hf_zero.sharding.stage3.units import Unit, assign_params_to_units, find_units, true_numel
from hf_zero.sharding.tiers import NvmeParams
from hf_zero.storage.buffer_pool import NoPool
from hf_zero.storage.host_budget import HostBudget
from hf_zero.storage.swap import SwapSpace, check_nvme_path, open_space

logger = logging.getLogger(__name__)


def zeropp_settings(config: ZeroConfig, topo: Topology) -> ZeroPPSettings:
    """The ZeRO++ parts the config switches on, with the groups they run over."""
    hpz = topo.hpz
    if hpz is not None and hpz.spans_nodes:
        logger.warning(
            "hf_zero ZeRO++: 'hpz_partition_size' = %s is larger than the %s data-parallel "
            "ranks of a node, so the backward gather still crosses nodes",
            hpz.size,
            topo.dp_intra_node.size,
        )
    if config.quantized_gradients and topo.dp_inter_node.size == 1:
        logger.info(
            "hf_zero ZeRO++: qgZ on a single node: one quantized all-to-all, no inter-node step"
        )
    return ZeroPPSettings(
        quantized_weights=config.quantized_weights,
        weight_bits=config.quantized_weights_bits,
        hpz=hpz,
        quantized_gradients=config.quantized_gradients,
        gradient_bits=config.quantized_gradients_bits,
        intra=topo.dp_intra_node,
        inter=topo.dp_inter_node,
        block_size=config.quantization_block_size,
        error_feedback=config.quantized_gradients_error_feedback,
        quantized_nontrainable_weights=config.frozen_format is not None,
        frozen_format=config.frozen_format or "int",
    )


class HostShare:
    """``offload_optimizer: cpu`` with ``offload_optimizer_ratio``: which buckets' masters live in
    host memory. Buckets are taken whole, in the order they are built, while the host's share
    stays nearest to ``ratio`` of the trainable elements (the same choice on every rank)."""

    def __init__(self, ratio: float, total_numel: int) -> None:
        self.target = ratio * total_numel
        self.numel = 0
        """Elements of the buckets chosen so far."""

    def takes(self, numel: int) -> bool:
        """Whether the next bucket built, of ``numel`` elements, goes to the host."""
        if self.numel + numel / 2 > self.target:
            return False
        self.numel += numel
        return True


def log_quantization_padding(zpp: ZeroPPSettings, groups: list[FlatParamGroup]) -> None:
    """Say once when buffers are shorter than, or not a multiple of, a quantization block."""
    if not (zpp.quantized_weights or zpp.quantized_gradients or zpp.quantized_nontrainable_weights):
        return
    block = zpp.block_size
    shards = [g.layout.shard_numel for g in groups]
    short = sum(n < block for n in shards)
    padded = sum(n >= block and n % block != 0 for n in shards)
    if short or padded:
        # Zero padding leaves every value's block and scale as they were: only shorter blocks
        # change the quantization, so only they are worth the user's attention.
        logger.log(
            logging.INFO if short else logging.DEBUG,
            "hf_zero ZeRO++: of %d buckets, %d have shards shorter than "
            "'quantization_block_size' = %d (they use one smaller block) and %d are padded "
            "to whole blocks",
            len(shards),
            short,
            block,
            padded,
        )


class GroupBuilder:
    """Builds the trainable groups (and, for stage 3, the units and frozen groups) of a model.

    After `build`: ``units`` (stage 3), ``frozen_groups`` (stage 3) and ``grouped`` (ids of every
    parameter that lives in a group).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        config: ZeroConfig,
        topology: Topology,
        comm: Collectives,
        zeropp: ZeroPPSettings,
        dtype: torch.dtype,
        tp_split: Callable[[torch.Tensor], bool],
        counted_in_norm: Callable[[torch.Tensor], bool] = lambda p: True,
        pool: NoPool | None = None,
    ) -> None:
        self.module, self.config, self.topology, self.comm = module, config, topology, comm
        self.pool = pool or NoPool()
        """Where stage-3 gathers take their buffers (`hf_zero.storage.buffer_pool`)."""
        self.zeropp, self.dtype, self.tp_split = zeropp, dtype, tp_split
        self.counted_in_norm = counted_in_norm
        """Whether a parameter's gradient counts in the global norm (its bucket's key)."""
        self.units: list[Unit] = []
        self.frozen_groups: list[FlatParamGroup] = []
        self.grouped: set[int] = set()
        self.swaps: dict[str, SwapSpace] = {}
        """ZeRO-Infinity: the rank's swap space per NVMe tier (one per distinct path)."""
        for tier in ("offload_param", "offload_optimizer"):
            if getattr(config, tier) == "nvme":
                key = f"{tier}.nvme_path" if getattr(config, f"{tier}_nvme_path") else "nvme_path"
                root = check_nvme_path(key, config.nvme_path_for(tier))
                shared = [s for s in self.swaps.values() if s.root == root]
                self.swaps[tier] = (
                    shared[0] if shared else open_space(root, topology.rank, config.nvme_io_threads)
                )
        self.nvme_params: NvmeParams | None = None
        """``offload_param: nvme``: the swap space and host-memory budget its tiers share."""
        if "offload_param" in self.swaps:
            budget = HostBudget(config.offload_param_max_in_cpu)
            self.nvme_params = NvmeParams(self.swaps["offload_param"], budget)

    def build(self, optimizer: torch.optim.Optimizer) -> list[FlatParamGroup]:
        """The trainable groups, in the order their reductions launch."""
        names: dict[int, str] = {}
        for name, p in self.module.named_parameters():
            names.setdefault(id(p), name)
        group_of = self._param_group_index(optimizer, names)
        ordered = list(dict.fromkeys(self.module.parameters()))
        left_out = [names[id(p)] for p in ordered if p.requires_grad and id(p) not in group_of]
        if left_out:
            warnings.warn(
                f"hf_zero: {len(left_out)} trainable parameters are not in the optimizer and will "
                f"not be updated or synchronised (first: {left_out[:3]})",
                stacklevel=4,
            )
        trainable = [p for p in ordered if p.requires_grad and id(p) in group_of]
        host = None
        if self.config.offload_optimizer == "cpu":
            host = HostShare(self.config.offload_optimizer_ratio, sum(map(true_numel, trainable)))
        # offload_optimizer: nvme - the buckets whose shards fit stay in host memory instead.
        cache = HostBudget(self.config.offload_optimizer_max_in_cpu)
        base = GroupSpec(
            stage=self.config.stage,
            dtype=self.dtype,
            reduce_dtype=dtype_of(self.config.communication_data_type, self.dtype),
            shard_group=self.topology.dp,
            rank=self.topology.rank,
            comm=self.comm,
            zeropp=self.zeropp,
            param_swap=self.nvme_params,
            compact_master=self.config.master_weights_dtype == "bf16",
            state_dtype=torch.bfloat16 if self.config.optimizer_states_dtype == "bf16" else None,
            pool=self.pool,
        )

        def spec_for(pg_index: int | None, numel: int, stage: int) -> GroupSpec:
            """Where this group's master and state live (host share, NVMe, or its host
            cache), and its parameter tier."""
            tier = self.config.offload_param if stage == 3 else "none"
            swap = self.swaps.get("offload_optimizer") if pg_index is not None else None
            if swap is not None and not cache.take(-(-numel // self.topology.dp.size)):
                where = "nvme"
            elif swap is not None or (
                pg_index is not None and host is not None and host.takes(numel)
            ):
                where, swap = "cpu", None
            else:
                where = "none"
            return replace(
                base, stage=stage, param_tier=tier, offload_optimizer=where, optimizer_swap=swap
            )

        def make(
            pg_index: int | None, params: list, stage: int, packed: bool = False
        ) -> FlatParamGroup:
            spec = spec_for(pg_index, sum(map(true_numel, params)), stage)
            group_names = [names[id(p)] for p in params]
            group = FlatParamGroup(0, pg_index, group_names, params, spec, packed=packed)
            for p in params:
                p._hf_zero_group = group  # found again by gathered_parameters()
            group.tp_split = self.tp_split(params[0])
            group.counted_in_norm = self.counted_in_norm(params[0])
            return group

        if self.config.stage == 3:
            threshold = self.config.param_persistence_threshold
            replicated = [p for p in trainable if true_numel(p) < threshold]
            groups = self._build_units(ordered, group_of, threshold, make)
        else:
            for module in self.module.modules():
                unshard(module, self.comm, self.topology.dp)  # whole under stages 0-2
            sliced = [p for p in dict.fromkeys(self.module.parameters()) if slice_of(p) is not None]
            unshard_params(sliced, self.comm, self.topology.dp)
            replicated, groups = trainable, []
        # Gradients become ready roughly in reverse order of registration.
        # Buckets never mix TP-split and replicated parameters (their norms add differently),
        # nor parameters the global norm counts with ones it leaves out.
        items = [
            ((group_of[id(p)], self.tp_split(p), self.counted_in_norm(p)), p)
            for p in reversed(replicated)
        ]
        stage = min(self.config.stage, 2)
        buckets = bucket_params(items, self.config.reduce_bucket_size)
        groups += [make(key[0], params, stage) for key, params in buckets]
        # Reductions launch in the order buckets complete: when their earliest parameter is done.
        position = {id(p): i for i, p in enumerate(ordered)}
        groups.sort(key=lambda g: -min(position[id(p)] for p in g.params))
        for index, group in enumerate(groups):
            group.index = index
        self.grouped = {id(p) for g in groups + self.frozen_groups for p in g.params}
        return groups

    @staticmethod
    def _param_group_index(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> dict:
        group_of = {}
        for index, param_group in enumerate(optimizer.param_groups):
            for p in param_group["params"]:
                if id(p) not in names:
                    raise ValueError(
                        f"hf_zero: optimizer param group {index} holds a tensor of shape "
                        f"{tuple(p.shape)} that is not a parameter of the model; build the "
                        "optimizer on model.parameters()"
                    )
                if id(p) in group_of:
                    raise ValueError(
                        f"hf_zero: parameter '{names[id(p)]}' appears in more than one "
                        "optimizer param group"
                    )
                group_of[id(p)] = index
        return group_of

    def _build_units(self, ordered, group_of, threshold, make) -> list[FlatParamGroup]:
        """Stage 3: one sharded group per (unit, param group), plus one for frozen parameters."""
        found = find_units(self.module, log=self.topology.rank == 0)
        owner = assign_params_to_units(self.module, [m for _, m in found])
        self.units = [Unit(i, name, m, is_root=i == 0) for i, (name, m) in enumerate(found)]
        members: dict[int, dict[int | None, list]] = {}
        for module in self.module.modules():
            if is_int8_linear(module):
                prepare_int8_module(module)  # before its bytes move into a group
        for p in ordered:
            if true_numel(p) < threshold:
                continue  # stays whole on every rank
            pg = group_of.get(id(p)) if p.requires_grad else None
            # bitsandbytes bytes get groups of their own, one per storage dtype.
            packed = p.dtype if is_packed(p) else None
            key = (pg, self.tp_split(p), packed)
            members.setdefault(owner[id(p)], {}).setdefault(key, []).append(p)
        sliced: dict[int, list] = {}  # a partitioned from_pretrained's slices, by unit
        for p in dict.fromkeys(self.module.parameters()):
            if slice_of(p) is not None:
                sliced.setdefault(owner[id(p)], []).append(p)
        groups = []
        unit_modules = {id(u.module) for u in self.units}
        for unit in self.units:
            unshard(unit.module, self.comm, self.topology.dp)  # whole while regrouped
            unshard_params(sliced.get(unit.index, []), self.comm, self.topology.dp)
            if unit.is_root:  # a wrapped partitioned root (PEFT over the model): its own slices
                for module in self.module.modules():
                    if id(module) not in unit_modules:
                        unshard(module, self.comm, self.topology.dp)
            for (pg, _, packed), params in members.get(unit.index, {}).items():
                group = make(pg, params, 3, packed=packed is not None)
                unit.groups.append(group)
                (groups if pg is not None else self.frozen_groups).append(group)
        return groups
