"""ZeRO++ collectives: quantized all-gather (qwZ) and hierarchical quantized reduce (qgZ).

qwZ: each rank quantizes its shard blockwise to INT8 (or INT4), the integer payload and the fp32
block scales are all-gathered, and every rank dequantizes every piece, its own included, so all
ranks compute with identical parameters.

qgZ replaces the gradient reduce-scatter over ``N = nodes x L`` ranks by two all-to-alls. The
flat gradient is ``[nodes, L, S]``: shard ``n * L + j`` belongs to local rank ``j`` of node ``n``.

1. intra-node: rank sends ``x[:, j, :]`` (quantized) to local rank ``j``; each rank dequantizes
   the ``L`` pieces it receives and sums them in fp32: the node's partial sum of its ``nodes``
   shards.
2. inter-node, among the ranks with the same local index: requantize, send piece ``n`` to node
   ``n``, dequantize and sum: this rank's shard of the global sum.

Only step 2 crosses nodes, with ``nodes x S`` quantized elements per rank instead of the full
``nodes x L x S`` 16-bit buffer of a flat reduce-scatter. With error feedback each stage keeps
the quantization residual of what it sent and adds it to what it sends next time, so rounding
errors cancel over steps instead of accumulating.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_zero.comm.collectives import Collectives
from hf_zero.quant import Quantized, dequantize_rows, fitted_block_size, quantize_rows
from hf_zero.topology import Group


@dataclass(frozen=True)
class ZeroPPSettings:
    """What ZeRO++ switches on for one engine, with the groups each part runs over."""

    quantized_weights: bool = False
    weight_bits: int = 8
    hpz: Group | None = None
    """Secondary-partition group (hpZ); ``None`` when hpZ is off."""
    quantized_gradients: bool = False
    gradient_bits: int = 8
    intra: Group | None = None
    """qgZ step 1: the data-parallel ranks of this node."""
    inter: Group | None = None
    """qgZ step 2: the data-parallel ranks with this rank's local index, one per node."""
    block_size: int = 256
    error_feedback: bool = False
    quantized_nontrainable_weights: bool = False
    """MixZ++: frozen stage-3 shards are stored quantized (``weight_bits``) once, for good."""


def quantize_shard(shard: torch.Tensor, bits: int, block_size: int) -> Quantized:
    """A flat shard as one quantized row (one smaller block if the shard is short)."""
    return quantize_rows(shard.view(1, -1), bits, fitted_block_size(shard.numel(), block_size))


class QuantizedGather:
    """An in-flight all-gather of quantized rows; `wait` dequantizes into the output buffer.

    Each rank contributes ``local`` (one row per shard it holds); ``gathered`` holds every
    rank's rows, in group order, once the gather has finished.
    """

    def __init__(
        self,
        comm: Collectives,
        output: torch.Tensor,
        local: Quantized,
        group: Group,
        async_op: bool,
    ) -> None:
        self.output = output
        rows = local.data.shape[0] * group.size
        data = local.data.new_empty((rows, local.data.shape[1]))
        scales = local.scales.new_empty((rows, local.scales.shape[1]))
        self.gathered = Quantized(data, scales, local.numel, local.bits, local.block_size)
        self._works = [
            comm.all_gather(data.view(-1), local.data.reshape(-1), group, async_op=async_op),
            comm.all_gather(scales.view(-1), local.scales.reshape(-1), group, async_op=async_op),
        ]

    def wait(self) -> None:
        for work in self._works:
            if work is not None:
                work.wait()
        q = self.gathered
        self.output.view(q.data.shape[0], q.numel).copy_(dequantize_rows(q))


class QuantizedReduceScatter:
    """Hierarchical quantized reduce of one flat gradient buffer into this rank's shard (qgZ).

    Owned by one `FlatParamGroup` (it keeps that group's error-feedback residuals). `launch`
    starts the intra-node all-to-all; `finish` completes both steps and returns the fp32 *sum*
    of this rank's shard across all ranks.
    """

    def __init__(self, comm: Collectives, settings: ZeroPPSettings, numel: int) -> None:
        self.comm = comm
        self.intra, self.inter = settings.intra, settings.inter
        self.bits = settings.gradient_bits
        self.error_feedback = settings.error_feedback
        self.nodes, self.local = self.inter.size, self.intra.size
        if numel % (self.nodes * self.local):
            raise ValueError(
                f"qgZ: buffer of {numel} elements does not split into {self.nodes} nodes x "
                f"{self.local} ranks"
            )
        self.shard_numel = numel // (self.nodes * self.local)
        chunk = self.nodes * self.shard_numel
        self.intra_block = fitted_block_size(chunk, settings.block_size)
        self.inter_block = fitted_block_size(self.shard_numel, settings.block_size)
        self.residuals: dict[str, torch.Tensor] = {}
        self._pending: tuple | None = None

    def launch(self, full: torch.Tensor, async_op: bool = True) -> None:
        """Start step 1 (intra-node) on the flat gradient ``full``."""
        if self.local == 1:
            self._pending = (full.float().view(1, -1), None, None)
            return
        rows = full.view(self.nodes, self.local, self.shard_numel).transpose(0, 1)
        q = self._quantize("intra", rows.reshape(self.local, -1), self.intra_block)
        data, scales = torch.empty_like(q.data), torch.empty_like(q.scales)
        works = [
            self.comm.all_to_all(data, q.data, self.intra, async_op=async_op),
            self.comm.all_to_all(scales, q.scales, self.intra, async_op=async_op),
        ]
        self._pending = (Quantized(data, scales, q.numel, q.bits, q.block_size), works, None)

    def finish(self) -> torch.Tensor:
        """Wait for step 1, run step 2 (inter-node) and return this rank's fp32 shard sum."""
        received, works, _ = self._pending
        self._pending = None
        if works is None:
            partial = received.view(-1)  # one rank per node: nothing to reduce in the node
        else:
            for work in works:
                if work is not None:
                    work.wait()
            partial = dequantize_rows(received).sum(dim=0)
        if self.nodes == 1:
            return partial
        q = self._quantize("inter", partial.view(self.nodes, -1), self.inter_block)
        data, scales = torch.empty_like(q.data), torch.empty_like(q.scales)
        self.comm.all_to_all(data, q.data, self.inter)
        self.comm.all_to_all(scales, q.scales, self.inter)
        return dequantize_rows(Quantized(data, scales, q.numel, q.bits, q.block_size)).sum(dim=0)

    def _quantize(self, step: str, rows: torch.Tensor, block_size: int) -> Quantized:
        if not self.error_feedback:
            return quantize_rows(rows, self.bits, block_size)
        rows = rows.float()
        residual = self.residuals.get(step)
        if residual is not None:
            rows = rows + residual
        q = quantize_rows(rows, self.bits, block_size)
        # A non-finite gradient (fp16 overflow, a skipped step) must not poison later steps.
        self.residuals[step] = torch.nan_to_num_(rows - dequantize_rows(q), 0.0, 0.0, 0.0)
        return q

    def residual_bytes(self) -> int:
        return sum(r.numel() * r.element_size() for r in self.residuals.values())
