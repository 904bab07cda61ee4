"""Reduce codecs: sum a bucket's gradients across the data-parallel group."""

from __future__ import annotations

import torch

from hf_zero.comm import Collectives, QuantizedReduceScatter, ZeroPPSettings
from hf_zero.comm.topology import Group


class NoReduce:
    """A frozen group: no gradients, nothing to reduce."""

    takes_output = False

    def launch(self, full: torch.Tensor, output: torch.Tensor | None, async_op: bool) -> None:
        raise RuntimeError("hf_zero: a frozen group has no gradients to reduce")

    def wait(self) -> None:
        """Nothing in flight."""

    def residual_bytes(self) -> int:
        return 0


class ReduceScatter:
    """Reduce-scatter: each rank ends with the sum of its own shard (stages 1-3)."""

    takes_output = True
    """`launch` writes into a caller's output buffer (the reducer's per-backward slab)."""

    def __init__(self, comm: Collectives, group: Group) -> None:
        self.comm, self.group = comm, group
        self._work = None
        self._output: torch.Tensor | None = None

    def launch(self, full: torch.Tensor, output: torch.Tensor, async_op: bool) -> None:
        self._output = output
        self._work = self.comm.reduce_scatter(output, full, self.group, async_op=async_op)

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()

    def finish(self) -> torch.Tensor:
        """Wait; the summed shard (not averaged)."""
        self.wait()
        out, self._work, self._output = self._output, None, None
        return out

    def residual_bytes(self) -> int:
        return 0


class AllReduce(ReduceScatter):
    """All-reduce of the whole buffer, in place (stage 0: every rank steps everything)."""

    takes_output = False

    def launch(self, full: torch.Tensor, output: torch.Tensor | None, async_op: bool) -> None:
        self._output = full
        self._work = self.comm.all_reduce(full, self.group, async_op=async_op)


class QgZReduce(ReduceScatter):
    """ZeRO++ qgZ: quantized all-to-all reduce-scatter, intra-node then inter-node, with
    optional error feedback (`QuantizedReduceScatter`); the sum comes back in fp32."""

    takes_output = False

    def __init__(self, comm: Collectives, settings: ZeroPPSettings, padded_numel: int) -> None:
        self.exchange = QuantizedReduceScatter(comm, settings, padded_numel)

    def launch(self, full: torch.Tensor, output: torch.Tensor | None, async_op: bool) -> None:
        self.exchange.launch(full, async_op=async_op)

    def wait(self) -> None:
        pass  # finish() waits: the dequantize-and-sum is part of it

    def finish(self) -> torch.Tensor:
        return self.exchange.finish()

    @property
    def residuals(self) -> dict:
        """Error-feedback residuals per micro-batch slot (inspection, tests)."""
        return self.exchange.residuals

    def residual_bytes(self) -> int:
        return self.exchange.residual_bytes()
