"""Process groups: pipeline, data parallel, tensor parallel, sequence parallel, intra-node and
inter-node.

Rank layout, pipeline outermost and tensor innermost (as Megatron and DeepSpeed lay them out):
``rank = (pp_index * dp_size + dp_index) * tp_size + tp_index``, so a tensor-parallel group is a
run of consecutive ranks (inside one node whenever ``tp_size`` divides the node size) and the
stages of one replica are ``dp_size * tp_size`` ranks apart. A "node" is a run
of ``node_size`` consecutive ranks; ``node_size`` defaults to ``LOCAL_WORLD_SIZE`` as set by
torchrun/accelerate, and can be set explicitly to simulate several nodes on one machine.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from hf_zero.comm.elastic import round_store, uses_agent_store, warn_if_shared_store
from hf_zero.comm.teardown import destroy_groups_at_exit


@dataclass(frozen=True)
class Group:
    """A process group with the facts the collectives layer needs for byte accounting."""

    pg: dist.ProcessGroup | None
    ranks: tuple[int, ...]
    spans_nodes: bool
    node_size: int | None = None
    """Ranks per node (nodes are runs of consecutive global ranks); None when not known."""
    hierarchy: tuple[Group, Group] | None = None
    """``(intra, inter)`` when the group spans nodes and splits into equal per-node parts:
    this rank's members on its own node (in group order), and the members at this rank's
    position on every node. Collectives use it to send each byte across the network once
    (`hf_zero.comm.hierarchical`)."""

    @property
    def size(self) -> int:
        return len(self.ranks)

    def rank_of(self, global_rank: int) -> int:
        return self.ranks.index(global_rank)

    def off_node(self, global_rank: int, peer: int) -> bool:
        """Whether ``peer`` (a global rank) is on another node than ``global_rank``; when the
        node layout is unknown, a group that spans nodes counts every peer as remote."""
        if self.node_size is None:
            return self.spans_nodes
        return global_rank // self.node_size != peer // self.node_size


@dataclass
class Topology:
    """The process groups one rank belongs to."""

    world_size: int
    rank: int
    tp_size: int
    node_size: int
    dp: Group
    tp: Group
    intra_node: Group
    inter_node: Group
    dp_control: Group
    """The data-parallel ranks on a CPU (gloo) group, for small control messages that must not
    synchronise the device stream."""
    dp_intra_node: Group
    """The data-parallel ranks on this rank's node (ZeRO++ qgZ step 1)."""
    dp_inter_node: Group
    """The data-parallel ranks with this rank's position inside its node, one per node (qgZ
    step 2)."""
    hpz: Group | None = None
    """ZeRO++ hpZ: runs of ``hpz_size`` consecutive data-parallel ranks; ``None`` when off."""
    sp: Group | None = None
    """Ulysses sequence parallelism: runs of ``sp_size`` consecutive data-parallel ranks that
    share each batch, a slice of every sequence each; ``None`` when off."""
    pp: Group | None = None
    """Pipeline parallelism: the ranks that pass activations to each other (one per stage, at
    this rank's data- and tensor-parallel position); ``None`` when off."""
    tied: Group | None = None
    """Pipelines: the first and last stage of this rank's pipeline (tied embedding copies sum
    their gradients); ``None`` on the stages between and without a pipeline."""

    @property
    def dp_size(self) -> int:
        return self.dp.size

    @property
    def pp_size(self) -> int:
        return self.pp.size if self.pp is not None else 1

    @property
    def pp_rank(self) -> int:
        return self.pp.rank_of(self.rank) if self.pp is not None else 0

    def rank_of(self, pp_rank: int, dp_rank: int, tp_rank: int) -> int:
        """The global rank at a position of the ``pp x dp x tp`` grid."""
        return grid_rank(pp_rank, dp_rank, tp_rank, self.dp_size, self.tp_size)

    @property
    def dp_rank(self) -> int:
        return self.dp.rank_of(self.rank)

    @property
    def data_size(self) -> int:
        """Data-parallel ranks that read different batches: sequence-parallel ranks share one."""
        return self.dp_size // (self.sp.size if self.sp is not None else 1)

    @property
    def data_rank(self) -> int:
        return self.dp_rank // (self.sp.size if self.sp is not None else 1)

    @property
    def tp_rank(self) -> int:
        return self.tp.rank_of(self.rank)

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.node_size

    @property
    def world(self) -> Group:
        """Every rank, on the default process group."""
        return Group(None, tuple(range(self.world_size)), self.num_nodes > 1, self.node_size)

    def node_of(self, global_rank: int) -> int:
        return global_rank // self.node_size

    def destroy(self) -> None:
        """Shut down every group this topology created (collective; same order on all ranks).

        Called before the default group is destroyed, so no gloo subgroup is left to be torn
        down by the interpreter at exit, in an arbitrary order per rank.
        """
        seen = []
        for group in (
            self.dp, self.tp, self.intra_node, self.inter_node, self.dp_control,
            self.dp_intra_node, self.dp_inter_node, self.hpz, self.sp, self.pp, self.tied,
        ):  # fmt: skip
            pg = group.pg if group is not None else None
            if pg is None or pg is dist.group.WORLD or any(pg is s for s in seen):
                continue
            seen.append(pg)
        for pg in seen:
            dist.destroy_process_group(pg)

    @classmethod
    def build(
        cls,
        tp_size: int = 1,
        node_size: int | None = None,
        hpz_size: int = 1,
        timeout: float | None = None,
        sp_size: int = 1,
        pp_size: int = 1,
    ) -> Topology:
        """Create every group. Collective: all ranks must call it with the same arguments.

        ``hpz_size > 1`` also creates the ZeRO++ secondary-partition groups; it must divide the
        data-parallel size; ``sp_size > 1`` the sequence-parallel groups; ``pp_size > 1`` the
        pipelines and their tied-embedding pairs. ``timeout``: seconds a collective of the
        groups created here (and of the default group, if it is created here) may wait before
        it fails.
        """
        if not dist.is_initialized():
            init_distributed(timeout=timeout)
        world, rank = dist.get_world_size(), dist.get_rank()
        if node_size is None:
            node_size = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if tp_size < 1 or world % tp_size:
            raise ValueError(
                f"zero config: 'tp_size' = {tp_size} must divide the world size {world}"
            )
        if pp_size < 1 or world % (pp_size * tp_size):
            raise ValueError(
                f"zero config: 'pp_size' = {pp_size} x 'tp_size' = {tp_size} must divide the "
                f"number of processes ({world}); the data-parallel size is the quotient"
            )
        if node_size < 1 or world % node_size:
            raise ValueError(
                f"zero config: 'node_size' = {node_size} must divide the world size {world}"
            )

        def make(members_of: list[tuple[int, ...]], backend: str | None = None) -> Group:
            mine = make_some(members_of, backend)
            assert mine is not None
            return mine

        def make_some(members_of: list[tuple[int, ...]], backend: str | None = None):
            # new_group is collective over the world: every rank creates every group, in order.
            mine = None
            for ranks in members_of:
                spans = len({r // node_size for r in ranks}) > 1
                if len(ranks) == world and backend is None:
                    pg = dist.group.WORLD
                else:
                    pg = dist.new_group(
                        list(ranks), backend=backend, timeout=timeout_delta(timeout)
                    )
                if rank in ranks:
                    mine = Group(pg, ranks, spans, node_size)
            return mine

        dp_size = world // (pp_size * tp_size)

        def at(p: int, d: int, t: int) -> int:
            return grid_rank(p, d, t, dp_size, tp_size)

        stages, tps = range(pp_size), range(tp_size)
        dp_members = [tuple(at(p, d, t) for d in range(dp_size)) for p in stages for t in tps]
        dp = make(dp_members)
        tp = make([tuple(at(p, d, t) for t in tps) for p in stages for d in range(dp_size)])
        num_nodes = world // node_size
        intra = make([tuple(n * node_size + i for i in range(node_size)) for n in range(num_nodes)])
        inter = make([tuple(n * node_size + i for n in range(num_nodes)) for i in range(node_size)])
        control = dp if dist.get_backend() == "gloo" else make(dp_members, backend="gloo")

        # Data-parallel ranks split by node; with tp_size = 1 these are the node groups.
        per_node = max(1, node_size // tp_size)
        if tp_size == 1 and pp_size == 1:
            dp_intra, dp_inter = intra, inter
        elif node_size % tp_size or dp_size % per_node or pp_size > 1:
            # No clean node split (a pipeline's stages share nodes in ways ZeRO++ and the
            # two-hop collectives, which pipelines do not use, need not know): one node.
            dp_intra, dp_inter = dp, Group(None, (rank,), spans_nodes=False)
        else:
            nodes = dp_size // per_node
            dp_intra = make(
                [m[n * per_node : (n + 1) * per_node] for m in dp_members for n in range(nodes)]
            )
            dp_inter = make([m[i::per_node] for m in dp_members for i in range(per_node)])

        if dp.spans_nodes and dp_intra.size > 1 and dp_inter.size > 1:
            # Plain ``dp`` stays the control group: small messages gain nothing from two hops.
            dp = dataclasses.replace(dp, hierarchy=(dp_intra, dp_inter))

        hpz = None
        if hpz_size > 1:
            if dp_size % hpz_size:
                raise ValueError(
                    f"zero config: 'hpz_partition_size' = {hpz_size} must divide the "
                    f"data-parallel size {dp_size}"
                )
            hpz = make(
                [m[i : i + hpz_size] for m in dp_members for i in range(0, dp_size, hpz_size)]
            )
        sp = None
        if sp_size > 1:
            if dp_size % sp_size:
                raise ValueError(
                    f"zero config: 'sp_size' = {sp_size} must divide the data-parallel size "
                    f"{dp_size}"
                )
            sp = make([m[i : i + sp_size] for m in dp_members for i in range(0, dp_size, sp_size)])
        pp = tied = None
        if pp_size > 1:
            positions = [(d, t) for d in range(dp_size) for t in tps]
            pp = make([tuple(at(p, d, t) for p in stages) for d, t in positions])
            tied = make_some([(at(0, d, t), at(pp_size - 1, d, t)) for d, t in positions])
        return cls(
            world, rank, tp_size, node_size, dp, tp, intra, inter, control, dp_intra, dp_inter,
            hpz, sp, pp, tied,
        )  # fmt: skip


def grid_rank(pp_rank: int, dp_rank: int, tp_rank: int, dp_size: int, tp_size: int) -> int:
    """The module docstring's layout: pipeline outermost, tensor innermost."""
    return (pp_rank * dp_size + dp_rank) * tp_size + tp_rank


def hpz_size(setting: int | str, tp_size: int, node_size: int | None) -> int:
    """``hpz_partition_size`` as a number; ``"auto"`` is the data-parallel ranks of one node."""
    if setting != "auto":
        return setting
    init_distributed()
    world = dist.get_world_size()
    node = node_size or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return max(1, node // tp_size)


def current_device() -> torch.device:
    """The device this rank computes on: ``cuda:LOCAL_RANK`` when CUDA is present, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def init_distributed(backend: str | None = None, timeout: float | None = None) -> None:
    """Initialise the default process group from the launcher's environment.

    Under torchrun/accelerate the usual ``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` variables are
    set. A plain ``python script.py`` gets a one-rank group, so the same code runs unlaunched.
    ``timeout``: seconds a collective may wait for the other ranks before it fails (torch's
    default, 30 minutes, when None). If the group exists already (the launcher's or Accelerate's),
    it is kept. Either way the groups are destroyed at a normal exit (`teardown`). Under a
    launcher that keeps its store across restarts (torchrun), the group is built on this
    restart round's own part of that store (`hf_zero.comm.elastic`).
    """
    destroy_groups_at_exit()
    if dist.is_initialized():
        warn_if_shared_store()
        return
    if backend is None:
        backend = "nccl" if current_device().type == "cuda" else "gloo"
    if current_device().type == "cuda":
        torch.cuda.set_device(current_device())
    if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ and uses_agent_store():
        wait = timeout_delta(timeout) or timedelta(minutes=30)
        dist.init_process_group(
            backend,
            store=round_store(wait),
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=wait,
        )
    elif "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, timeout=timeout_delta(timeout))
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def timeout_delta(seconds: float | None) -> timedelta | None:
    """``seconds`` as the timeout torch takes (None: torch's default)."""
    return timedelta(seconds=seconds) if seconds else None
