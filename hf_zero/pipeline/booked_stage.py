"""`BookedStage`: torch's ``PipelineStage`` whose sends to the neighbouring stages are booked.

The schedules of ``torch.distributed.pipelining`` ask each stage for the point-to-point
operations of a micro-batch (its activations forward, the gradients of its inputs backward) and
issue them themselves. Booking each send where the stage hands it out puts what pipelines put on
the wire into `CommStats` (purpose ``"pp"``, kind ``send``), next to ZeRO's own traffic.
Receives are not booked: their bytes are the peer's sends. The one exchange not booked is the
shape inference of a schedule's first step (pickled tensor metadata, once per micro-batch
shape).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from hf_zero.comm.collectives import Collectives
from hf_zero.comm.topology import Group


class BookedStage(PipelineStage):
    """A ``PipelineStage`` over ``group`` (the pipeline's ranks) that books its sends in
    ``comm``'s stats."""

    def __init__(
        self,
        submodule: torch.nn.Module,
        stage_index: int,
        num_stages: int,
        device: torch.device,
        group: Group,
        comm: Collectives,
    ) -> None:
        super().__init__(submodule, stage_index, num_stages, device, group=group.pg)
        self._pipeline, self._comm = group, comm

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self._booked(super().get_fwd_send_ops(fwd_chunk_id))

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return self._booked(super().get_bwd_send_ops(bwd_chunk_id))

    def _booked(self, ops: list[dist.P2POp]) -> list[dist.P2POp]:
        for op in ops:
            if op.op is dist.isend:
                self._comm.book_send(op.tensor, op.peer, self._pipeline)
        return ops
