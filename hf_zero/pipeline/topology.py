"""Process groups for pipeline x data x tensor parallelism (3D).

Rank layout, pipeline outermost and tensor innermost (as Megatron and DeepSpeed lay them out):
``rank = (pp_rank * dp_size + dp_rank) * tp_size + tp_rank``. A tensor-parallel group is a run of
consecutive ranks (inside one node when ``tp_size`` divides the node size, where its frequent
all-reduces belong); the stages of one replica are ``dp_size * tp_size`` ranks apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from hf_zero.comm.topology import Group, timeout_delta


@dataclass
class PipelineTopology:
    """The groups one rank belongs to: its pipeline (same dp/tp position, every stage), its
    stage's data-parallel and tensor-parallel groups, and the tied-embedding pair."""

    rank: int
    pp_size: int
    dp_size: int
    tp_size: int
    pp: Group
    """The ranks that pass activations to each other (one per stage)."""
    dp: Group
    """This stage's replicas at this TP position: gradients are averaged (ZeRO-sharded) here."""
    tp: Group
    tied: Group | None
    """First and last stage of this pipeline (tied embedding copies sum their gradients);
    ``None`` on the stages between."""

    @property
    def pp_rank(self) -> int:
        return self.pp.rank_of(self.rank)

    @property
    def dp_rank(self) -> int:
        return self.dp.rank_of(self.rank)

    @property
    def tp_rank(self) -> int:
        return self.tp.rank_of(self.rank)

    def destroy(self) -> None:
        """Shut down the groups this rank belongs to (before the default group goes)."""
        seen = []
        for group in (self.pp, self.dp, self.tp, self.tied):
            pg = group.pg if group is not None else None
            if pg is not None and pg is not dist.group.WORLD and all(pg is not s for s in seen):
                seen.append(pg)
        for pg in seen:
            dist.destroy_process_group(pg)

    def rank_of(self, pp_rank: int, dp_rank: int, tp_rank: int) -> int:
        return (pp_rank * self.dp_size + dp_rank) * self.tp_size + tp_rank

    @classmethod
    def build(
        cls, pp_size: int, tp_size: int = 1, timeout: float | None = None
    ) -> PipelineTopology:
        """Create every group (collective: every rank calls it with the same arguments);
        ``timeout``: seconds their collectives may wait before they fail."""
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % (pp_size * tp_size):
            raise ValueError(
                f"zero config: 'pp_size' = {pp_size} x 'tp_size' = {tp_size} must divide the "
                f"number of processes ({world}); the data-parallel size is the quotient"
            )
        dp_size = world // (pp_size * tp_size)

        def at(p: int, d: int, t: int) -> int:
            return (p * dp_size + d) * tp_size + t

        def make(members_of: list[tuple[int, ...]]) -> Group | None:
            mine = None  # new_group is collective over the world: every rank creates every group
            for ranks in members_of:
                pg = (
                    dist.group.WORLD
                    if len(ranks) == world
                    else dist.new_group(list(ranks), timeout=timeout_delta(timeout))
                )
                if rank in ranks:
                    mine = Group(pg, ranks, spans_nodes=False)
            return mine

        positions = [(d, t) for d in range(dp_size) for t in range(tp_size)]
        pp = make([tuple(at(p, d, t) for p in range(pp_size)) for d, t in positions])
        dp = make(
            [tuple(at(p, d, t) for d in range(dp_size)) for p in range(pp_size)
             for t in range(tp_size)]
        )  # fmt: skip
        tp = make(
            [tuple(at(p, d, t) for t in range(tp_size)) for p in range(pp_size)
             for d in range(dp_size)]
        )  # fmt: skip
        tied = make([(at(0, d, t), at(pp_size - 1, d, t)) for d, t in positions])
        return cls(rank, pp_size, dp_size, tp_size, pp, dp, tp, tied)
