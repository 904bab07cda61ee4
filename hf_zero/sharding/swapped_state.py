"""``offload_optimizer: nvme``: a group's master shard, gradient and optimizer state on disk.

ZeRO-Infinity keeps no optimizer-side tensor of a trainable group in memory between steps:
`SwappedState` owns one swap file each for the master shard, its reduced fp32 gradient and every
elementwise optimizer state tensor (``exp_avg``, ``exp_avg_sq``, ... as the optimizer creates
them on its first step); scalar state (``step``) stays in memory. The master is fp32
(`Fp32Master`), or bf16 (`Bf16Master`, ``master_weights_dtype: bf16``: each tile stepped in fp32
and rounded back). The optimizer step streams the files tile by tile
(`hf_zero.optim.streamed_step`), and checkpoints read and write them one group at a time.

`SwappedGrads` is the gradient side (the `GradStore` interface the optimizer uses): each reduced
shard is averaged, its sum of squares and finiteness noted for the global norm, and written out
as soon as it lands on the host; a later micro-batch of the same window reads it back and adds.
Unscale and clip factors are kept and applied to each tile inside the step.
"""

from __future__ import annotations

import torch

from hf_zero.numerics.rounding import ShardRounding
from hf_zero.observe import clock
from hf_zero.sharding.grad_store import landed_average
from hf_zero.storage.swap import SwapFile, SwapSpace


class Fp32Master:
    """An fp32 master in its file: the step updates each tile in its read buffer."""

    dtype = torch.float32

    def widened(self, tile: torch.Tensor) -> torch.Tensor:
        """The fp32 tensor the optimizer steps for the master ``tile`` (the tile itself)."""
        return tile

    def begin_step(self) -> None:
        """Once per step of the shard, before its first tile."""

    def narrow(self, tile: torch.Tensor, work: torch.Tensor, state: dict, offset: int) -> None:
        """Put the stepped ``work`` (elements ``offset ..`` of the shard) back into ``tile``
        (nothing to do here: ``work`` is ``tile``)."""


class Bf16Master:
    """A bf16 master in its file (``master_weights_dtype: bf16``): each tile is widened to
    fp32 for the step and rounded back by the shard's `ShardRounding`, which draws an element's
    random bits by its position, so tiles round as the whole shard does on the device."""

    dtype = torch.bfloat16

    def __init__(self, rounding: ShardRounding) -> None:
        self.rounding = rounding

    def widened(self, tile: torch.Tensor) -> torch.Tensor:
        return tile.float()

    def begin_step(self) -> None:
        self.rounding.begin_step()

    def narrow(self, tile: torch.Tensor, work: torch.Tensor, state: dict, offset: int) -> None:
        tile.copy_(self.rounding.round(work, state, offset))


class SwappedState:
    """One trainable group's master shard, gradient and optimizer state in swap files."""

    def __init__(
        self,
        space: SwapSpace,
        master: torch.Tensor,
        world: int,
        file: SwapFile | None = None,
        state_dtype: torch.dtype | None = None,
        kind: Fp32Master | Bf16Master | None = None,
    ) -> None:
        """``file``: the parameter shard's swap file, which holds ``master`` already (parameters
        in the master's dtype): the master's values live there, one file for both.
        ``state_dtype``: floating-point state tensors are kept in that dtype in their files
        (``optimizer_states_dtype: bf16``; the step widens each tile), else as the optimizer
        makes them. ``kind``: how the master is kept (`Fp32Master` unless given)."""
        self.space = space
        self.state_dtype = state_dtype
        self.master_kind = kind or Fp32Master()
        """How the master is kept in its file, and stepped a tile at a time."""
        self.numel = master.numel()
        nbytes = self.numel * self.master_kind.dtype.itemsize
        self.files: dict[str, SwapFile] = {"master": file or space.file("master", nbytes)}
        self.dtypes: dict[str, torch.dtype] = {"master": self.master_kind.dtype}
        self.state_keys: list[str] = []
        """Elementwise optimizer state tensors kept in files (known after the first step)."""
        self.scalars: dict = {}
        """Scalar optimizer state (``step``), the same for every tile."""
        if file is None:
            self.write_master(master)
        self.grads = SwappedGrads(self, world)

    # --- whole tensors (initialisation, checkpoints, consolidation) --------------------------
    def read(self, key: str) -> torch.Tensor:
        """The whole of ``key`` (``master`` or a state name), read into a new host tensor."""
        buffer = self.space.buffer(self.numel, self.dtypes[key])
        return self.files[key].read(buffer).clone()

    def write(self, key: str, values: torch.Tensor) -> None:
        """Replace the whole of ``key`` with ``values`` (a new state key gets its file)."""
        if key not in self.files:
            self.add_key(key, self.kept_dtype(values))
        buffer = self.space.buffer(self.numel, self.dtypes[key])
        buffer.copy_(values.reshape(-1))
        self.files[key].write(buffer)

    def kept_dtype(self, value: torch.Tensor) -> torch.dtype:
        """The dtype a state tensor like ``value`` has in its file."""
        return self.state_dtype if self.state_dtype and value.is_floating_point() else value.dtype

    def add_key(self, key: str, dtype: torch.dtype) -> None:
        nbytes = self.numel * torch.empty(0, dtype=dtype).element_size()
        self.files[key] = self.space.file(key, nbytes)
        self.dtypes[key] = dtype
        if key not in ("master", "grad"):
            self.state_keys.append(key)

    def read_master(self) -> torch.Tensor:
        return self.read("master")

    def write_master(self, values: torch.Tensor) -> None:
        self.write("master", values)  # into the file's dtype

    def read_state(self) -> dict:
        """The optimizer state as torch keeps it (tensors of the shard's size, scalars)."""
        state = {key: self.read(key) for key in self.state_keys}
        state.update({k: v.clone() if torch.is_tensor(v) else v for k, v in self.scalars.items()})
        return state

    def write_state(self, state: dict) -> None:
        """Take the optimizer state of this shard (a loaded checkpoint, a user's state)."""
        for key, value in state.items():
            if torch.is_tensor(value) and value.numel() == self.numel and value.dim() > 0:
                self.write(key, value)
            else:
                self.scalars[key] = value

    def held_bytes(self) -> dict[str, int]:
        on_disk = {"nvme_master_weights": self.files["master"].nbytes}
        on_disk["nvme_optimizer_states"] = sum(self.files[k].nbytes for k in self.state_keys)
        on_disk["nvme_grads"] = self.files["grad"].nbytes if "grad" in self.files else 0
        on_disk["host_grads"] = self.grads.resident_bytes()
        return on_disk


class SwappedGrads:
    """The reduced fp32 gradient of a `SwappedState`, written out as it arrives."""

    def __init__(self, owner: SwappedState, world: int) -> None:
        self.owner = owner
        self.world = world
        self.present = False
        self.factors: list[float] = []
        """Unscale / clip multipliers still to apply (per tile, in the step)."""
        self._square_sum: torch.Tensor | None = None
        self._finite = True
        self._host: tuple[torch.Tensor, object] | None = None  # a device-to-host copy in flight
        self._writing = None

    def fold_host(self, host: torch.Tensor, done, accumulate: bool) -> None:
        """A reduced sum is being copied into ``host`` (``done``: CUDA event, or None); it is
        landed and written out at once, so no group's gradient waits in memory for the step.
        It counts once `commit` says some rank had a gradient."""
        if not accumulate:
            self.present = False  # replaced, as `GradStore.fold` replaces
        self._host = (host, done)
        self.land_host()

    def commit(self, received: bool) -> None:
        """End of backward: the landed sum counts if any rank had a gradient for the group
        (else it was zeros: an earlier micro-batch's sum is unchanged, or there is none)."""
        self.present = self.present or received

    def land_host(self) -> None:
        """Average the landed copy, add it to an earlier micro-batch's, note its norm, write."""
        if self._host is None:
            return
        # The copy landed in an aligned swap buffer (`FlatParamGroup.land_reduce`): written as is.
        buffer, self._host = landed_average(self._host, self.world), None
        owner = self.owner
        if "grad" not in owner.files:
            owner.add_key("grad", torch.float32)
        self._wait_write()
        if self.present:  # an earlier micro-batch's sum: old + new, the order `GradStore` adds in
            old = owner.files["grad"].read(owner.space.buffer(owner.numel, torch.float32))
            buffer = old.add_(buffer)
        self._square_sum = buffer.pow(2).sum()
        self._finite = bool(torch.isfinite(buffer).all())
        # Only the future is kept: the I/O thread drops the buffer once it is written.
        self._writing = (buffer.numel() * 4, owner.files["grad"].write_async(buffer))
        del buffer
        self.factors = []

    def _wait_write(self) -> None:
        if self._writing is not None:
            clock.waited("disk_io", self._writing[1])
            self._writing = None

    def settle(self) -> None:
        self.land_host()
        self._wait_write()

    def all_finite(self) -> bool:
        return self._finite

    def scale_(self, factor: float) -> None:
        self.factors.append(factor)

    def square_sum(self) -> torch.Tensor:
        if not self.factors:
            return self._square_sum
        grad = self.read()
        return grad.pow(2).sum()

    def read(self) -> torch.Tensor:
        """The whole fp32 gradient with its factors applied (a new host tensor)."""
        self.settle()
        grad = self.owner.read("grad")
        for factor in self.factors:
            grad.mul_(factor)
        return grad

    def clear(self) -> None:
        self.settle()
        self.present = False
        self.factors = []
        self._square_sum = None
        self._finite = True

    def resident_bytes(self) -> int:
        writing = self._writing is not None and not self._writing[1].done()
        return self._writing[0] if writing else 0
