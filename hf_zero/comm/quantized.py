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
from hf_zero.comm.topology import Group
from hf_zero.numerics.quant import (
    Quantized,
    dequantize_rows,
    dequantize_rows_into,
    fitted_block_size,
    quantize_rows,
    quantize_segments,
)
from hf_zero.observe import clock


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
    """MixZ++: frozen stage-3 shards are stored quantized once, for good."""
    frozen_format: str = "int"
    """MixZ++'s storage: ``"int"`` (INT8/INT4 blocks of ``weight_bits``), ``"nf4"`` or ``"fp4"``
    (bitsandbytes' 4-bit formats)."""


def pack(q: Quantized) -> torch.Tensor:
    """``q``'s rows as one byte tensor, ``[rows, payload (padded to 4 bytes) + scales]``: each
    peer gets one message instead of two, which halves the rounds a collective of small
    pieces waits for."""
    rows, payload = q.data.shape[0], q.data.shape[1] * q.data.element_size()
    width = -(-payload // 4) * 4
    packed = torch.empty(rows, width + 4 * q.scales.shape[1], dtype=torch.uint8,
                         device=q.data.device)  # fmt: skip
    packed[:, :payload].copy_(q.data.view(torch.uint8))
    packed[:, width:].copy_(q.scales.view(torch.uint8))
    return packed


def unpack(packed: torch.Tensor, like: Quantized) -> Quantized:
    """The `Quantized` whose rows `pack` laid out in ``packed`` (views, no copy); ``like``
    gives the format (any rows)."""
    payload = like.data.shape[1] * like.data.element_size()
    width = -(-payload // 4) * 4
    data = packed[:, :payload].view(like.data.dtype)
    scales = packed[:, width:].view(torch.float32)
    return Quantized(data, scales, like.numel, like.bits, like.block_size, like.format)


@clock.timed("quantize")
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
        sent = pack(local)
        received = sent.new_empty((sent.shape[0] * group.size, sent.shape[1]))
        self.gathered = unpack(received, local)
        self._works = [comm.all_gather(received.view(-1), sent.view(-1), group, async_op=async_op)]

    def wait(self) -> None:
        for work in self._works:
            if work is not None:
                work.wait()
        with clock.phase("quantize"):
            dequantize_rows_into(self.gathered, self.output)


class QuantizedReduceScatter:
    """Hierarchical quantized reduce of one flat gradient buffer into this rank's shard (qgZ).

    Owned by one `FlatParamGroup` (it keeps that group's error-feedback residuals). `launch`
    quantizes and starts step 1 (intra-node); on CPU, step 2 (inter-node) runs on a background
    thread as soon as step 1 has arrived, so it crosses the network while backward goes on;
    `finish` waits and returns the fp32 *sum* of this rank's shard across all ranks.
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
        self._pending = None

    def launch(self, full: torch.Tensor, async_op: bool = True) -> None:
        """Start step 1 (intra-node) on the flat gradient ``full``; step 2 follows by itself."""
        if self.local == 1:
            received, works = None, None
        else:
            # [nodes, local, S]: row j (to local rank j) is x[:, j, :], read in place.
            pieces = full.view(self.nodes, self.local, self.shard_numel)
            rows = [[pieces[n, j] for n in range(self.nodes)] for j in range(self.local)]
            q = self._quantize("intra", rows, self.intra_block)
            sent = pack(q)
            arrived = torch.empty_like(sent)
            received = unpack(arrived, q)
            works = [self.comm.all_to_all(arrived, sent, self.intra, async_op=async_op)]

        def rest() -> torch.Tensor:
            return self._step2(self._step1_sum(full, received, works))

        # On CPU (gloo) step 2 starts on a worker as soon as step 1 lands. On GPUs it stays in
        # `finish`, on the training thread's stream, until that path has been measured there.
        if async_op and self.nodes > 1 and full.device.type == "cpu":
            self._pending = self.comm.reductions.submit_call(rest)
        else:
            self._pending = rest

    def finish(self) -> torch.Tensor:
        """Wait for both steps; this rank's fp32 shard sum."""
        pending, self._pending = self._pending, None
        return pending() if callable(pending) else pending.result()

    def _step1_sum(self, full, received: Quantized | None, works) -> torch.Tensor:
        """This node's partial sums ``[nodes, S]`` of this rank's shards (fp32)."""
        if received is None:  # one rank per node: nothing to reduce in the node
            return full.view(self.nodes, self.shard_numel).float()
        for work in works:
            if work is not None:
                work.wait()
        partial = torch.empty(self.nodes, self.shard_numel, dtype=torch.float32, device=full.device)
        for peer in range(self.local):  # in rank order: deterministic
            piece = Quantized(
                received.data[peer : peer + 1], received.scales[peer : peer + 1],
                received.numel, received.bits, received.block_size,
            )  # fmt: skip
            dequantize_rows_into(piece, partial, accumulate=peer > 0)
        return partial

    def _step2(self, partial: torch.Tensor) -> torch.Tensor:
        """Across nodes: requantize the partial sums, exchange, dequantize and sum."""
        if self.nodes == 1:
            return partial.view(-1)
        q = self._quantize("inter", [[row] for row in partial], self.inter_block)
        sent = pack(q)
        arrived = torch.empty_like(sent)
        self.comm.all_to_all(arrived, sent, self.inter)
        total = torch.empty(1, self.shard_numel, dtype=torch.float32, device=partial.device)
        for node in range(self.nodes):
            piece = unpack(arrived[node : node + 1], q)
            dequantize_rows_into(piece, total, accumulate=node > 0)
        return total.view(-1)

    @clock.timed("quantize")
    def _quantize(self, step: str, rows: list[list[torch.Tensor]], block: int) -> Quantized:
        """Quantize rows given as lists of pieces (`quantize_segments`), with error feedback
        when it is on."""
        if not self.error_feedback:
            return quantize_segments(rows, self.bits, block)
        dense = torch.stack([torch.cat(pieces).float() for pieces in rows])
        residual = self.residuals.get(step)
        if residual is not None:
            dense = dense + residual
        q = quantize_segments([[row] for row in dense], self.bits, block)
        # A non-finite gradient (fp16 overflow, a skipped step) must not poison later steps.
        self.residuals[step] = torch.nan_to_num_(dense - dequantize_rows(q), 0.0, 0.0, 0.0)
        return q

    def residual_bytes(self) -> int:
        return sum(r.numel() * r.element_size() for r in self.residuals.values())
