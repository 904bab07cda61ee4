"""A trainable group's master weights: where they live, in which dtype, how a reduced gradient
reaches them, and how stepped values leave them for the parameters.

====================  =========================================  ============================
kind                  this rank's master shard                   chosen when
====================  =========================================  ============================
`AliasedMaster`       is the parameters' own fp32 values,        fp32, no offload, the
                      stepped in place (no copy)                 parameters on the device
`DeviceMaster`        an fp32 copy on the device                 16-bit parameters, or fp32
                                                                 ones in the host tier
`HostMaster`          an fp32 copy in host memory                ``offload_optimizer: cpu``
                      (ZeRO-Offload)
`SwappedMaster`       in swap files, with its gradient and       ``offload_optimizer: nvme``
                      optimizer state (ZeRO-Infinity); fp32,
                      or bf16 (stepped tile by tile as below)
`CompactMaster`       is the parameters' own 16-bit values;      ``master_weights_dtype:
                      each step computes in fp32 on a            bf16``, no offload
                      one-bucket copy and rounds back
`DeviceCompactMaster` a bf16 copy on the device, stepped so      the same, parameters
                                                                 offloaded (``offload_param``)
`HostCompactMaster`   a bf16 copy in host memory, stepped so     the same, ``cpu``
====================  =========================================  ============================

Optimizer state may be stored in 16 bits too (``optimizer_states_dtype: bf16``, any kind kept in
device memory): the step then widens one bucket's state to fp32, steps, and narrows it back, so
the optimizer's arithmetic is fp32 and only what is kept between steps is 16-bit.

The group picks one at construction (`master_weights`) and never asks which it has. A master
hands the parameters' side (`hf_zero.sharding.placement`) either a shard of updated values, or
nothing (`updated` returns None: the step already changed the parameters), or
`TILES_SENT` (offload: the step sent each finished tile as it went).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from hf_zero.numerics.rounding import ShardRounding
from hf_zero.observe import clock
from hf_zero.sharding.grad_intake import OWN_REGION, WHOLE_16BIT
from hf_zero.sharding.grad_store import GradStore, start_copy
from hf_zero.sharding.placement import Placement
from hf_zero.sharding.swapped_state import Bf16Master, Fp32Master, SwappedState
from hf_zero.storage.swap import SwapFile, SwapSpace

TILES_SENT = "tiles sent"
"""`updated`: the step already sent its values, tile by tile, to the placement."""


class MasterWeights:
    """An fp32 master shard on the device; the base of every kind."""

    location = "device"
    """Where the master, its gradient and the optimizer state live: device, host or nvme."""
    swapped = None
    """The `SwappedState` (swap files) under ``offload_optimizer: nvme``; None otherwise."""
    lands_early = False
    """Each reduced shard is written out as soon as its reduction is waited for (`land`)."""

    def __init__(self, param: torch.Tensor, world: int) -> None:
        self.param = torch.nn.Parameter(param, requires_grad=False)
        """What the user's optimizer steps (empty under NVMe: the values are in files)."""
        self.grads = GradStore(self.param, world)
        """The reduced gradient from its reduction to the step."""

    # --- the gradient -------------------------------------------------------------------------
    def finish_reduction(self, codec, intake, received: bool) -> None:
        """Wait for the bucket's reduction and take its sum (``received``: some rank had a
        gradient for the bucket; otherwise the optimizer skips it rather than step with 0)."""
        reduced, form = intake.settle(codec.finish())
        if received:
            self.take_gradient(reduced, intake.accumulates, form)

    def take_gradient(self, reduced: torch.Tensor, accumulate: bool, form: str) -> None:
        if form == WHOLE_16BIT:
            # Averaged in place, as DDP does, so a later synced backward before the step adds
            # to an average and the next all-reduce is again the exact total.
            self.grads.fold(reduced.div_(self.grads.world), False, averaged=True)
        else:
            self.grads.fold(reduced, accumulate, average_now=form != OWN_REGION)

    def land(self, codec) -> None:
        """Write a finished reduction out before the end of backward (NVMe only)."""

    # --- the values ---------------------------------------------------------------------------
    def values(self) -> torch.Tensor:
        return self.param.detach()

    def set_values(self, values: torch.Tensor) -> None:
        self.param.data.copy_(values)

    def send_tile(self, start: int, end: int, values, placement: Placement) -> None:
        raise RuntimeError(f"hf_zero: a {type(self).__name__} sends no tiles (offload only)")

    # --- the step ---------------------------------------------------------------------------
    state_dtype: torch.dtype | None = None
    """Elementwise optimizer state is kept in this dtype between steps (None: as the optimizer
    makes it)."""

    def kept_dtype(self, optimizer: torch.optim.Optimizer) -> torch.dtype:
        """The dtype elementwise state is kept in between steps: the config's, else the
        optimizer's own (`CPUAdam`'s ``state_dtype``), else fp32."""
        return self.state_dtype or getattr(optimizer, "state_dtype", torch.float32)

    @contextmanager
    def stepped(self, optimizer: torch.optim.Optimizer) -> Iterator[torch.nn.Parameter]:
        """The parameter the optimizer steps for this master: itself, or (16-bit state) itself
        with its state widened to fp32 for the step and narrowed after."""
        if self.state_dtype is None:
            yield self.param
            return
        state = optimizer.state.pop(self.param, {})
        optimizer.state[self.param] = _widened(state, self.param.numel())
        try:
            yield self.param
        finally:
            state = optimizer.state.pop(self.param, {})
            optimizer.state[self.param] = _narrowed_state(
                state, self.param.numel(), self.state_dtype
            )

    # --- the optimizer's state ----------------------------------------------------------------
    def adopt_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Take state the optimizer already holds for ``param`` (kept there, in memory)."""

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        return optimizer.state.get(self.param, {})

    def state_spec(self, optimizer: torch.optim.Optimizer) -> dict[str, tuple[torch.dtype, tuple]]:
        """Dtype and shape of each state tensor, without reading them."""
        return _tensor_spec(optimizer.state.get(self.param, {}).items())

    def load(self, master: torch.Tensor, state: dict, optimizer, placement: Placement) -> None:
        """Replace the master shard and its optimizer state (a loaded checkpoint); the caller
        then brings the parameters up to date (`FlatParamGroup.refresh_params`)."""
        self.param.copy_(master)
        state = {k: v.to(self.param.device) if torch.is_tensor(v) else v for k, v in state.items()}
        # A checkpoint's state in the dtype this run keeps it in (fp32 or 16-bit state saved by
        # another run loads either way).
        state = _narrowed_state(state, self.param.numel(), self.kept_dtype(optimizer))
        if state:
            optimizer.state[self.param] = state

    def updated(self, placement: Placement) -> torch.Tensor | str | None:
        """After the step: what the parameters must take on (see the module docstring)."""
        return self.param.detach()

    def held_bytes(self, grads: int, flat_grad) -> dict[str, int]:
        """``memory_report()`` kinds: ``grads`` (the group's own gradient bytes) plus what the
        master holds."""
        master = self.param.numel() * self.param.element_size()
        return {"grads": grads + self.grads.held_bytes(flat_grad), "master_weights": master}


class AliasedMaster(MasterWeights):
    """fp32 without offload: the master is the parameters' own values (``view``), no copy.
    ``complete``: stepping it updates every parameter (stage 0's whole buffer, a stage-3
    shard); otherwise (stages 1-2) the other ranks' regions are all-gathered after the step."""

    def __init__(self, view: torch.Tensor, world: int, complete: bool) -> None:
        super().__init__(view, world)
        self.complete = complete

    def set_values(self, values: torch.Tensor) -> None:
        pass  # the caller wrote the parameters, which are the master

    def updated(self, placement: Placement) -> torch.Tensor | None:
        return None if self.complete else self.param.detach()

    def held_bytes(self, grads: int, flat_grad) -> dict[str, int]:
        return {"grads": grads + self.grads.held_bytes(flat_grad), "master_weights": 0}


class DeviceMaster(MasterWeights):
    """An fp32 copy of the shard on the device (mixed precision)."""


class HostMaster(MasterWeights):
    """ZeRO-Offload: master, gradient and optimizer state in host memory (pinned on CUDA).
    Reduced gradients are copied device-to-host as soon as each reduction is waited for, so no
    device buffer holds the rank's gradient shard until the end of backward; updated tiles go
    back host-to-device as the step finishes them."""

    location = "host"
    lands_early = True

    def __init__(
        self, values: torch.Tensor, world: int, pin: bool, dtype: torch.dtype = torch.float32
    ) -> None:
        host = torch.empty(values.numel(), dtype=dtype, device="cpu", pin_memory=pin)
        super().__init__(host.copy_(values), world)
        self.pin = pin
        self._sent = False
        self._landed: tuple[torch.Tensor, object] | None = None
        """A reduction copied to the host before the end of backward, not yet committed."""

    def _to_host(self, reduced: torch.Tensor) -> tuple[torch.Tensor, object]:
        with clock.phase("copy"):
            host = torch.empty(
                reduced.numel(), dtype=torch.float32, device="cpu", pin_memory=self.pin
            )
            return host, start_copy(host, reduced)

    def take_gradient(self, reduced: torch.Tensor, accumulate: bool, form: str) -> None:
        self.grads.fold_host(*self._to_host(reduced), accumulate)

    def land(self, codec) -> None:
        if self._landed is None:
            self._landed = self._to_host(codec.finish())

    def finish_reduction(self, codec, intake, received: bool) -> None:
        # Only at the end of backward does every rank know whether any had a gradient.
        landed, self._landed = self._landed, None
        if landed is None:
            super().finish_reduction(codec, intake, received)
        elif received:
            self.grads.fold_host(*landed, intake.accumulates)

    def send_tile(self, start: int, end: int, values, placement: Placement) -> None:
        """Start copying updated elements ``[start, end)`` (``values``, or read from the
        master) to where the parameters live."""
        with clock.phase("copy"):
            placement.receive_tile(start, self.values()[start:end] if values is None else values)
        self._sent = True

    def updated(self, placement: Placement) -> str:
        sent, self._sent = self._sent, False
        if not sent:  # an optimizer that steps untiled: send the whole shard now
            self.send_tile(0, self.param.numel(), None, placement)
            self._sent = False
        return TILES_SENT

    def held_bytes(self, grads: int, flat_grad) -> dict[str, int]:
        master = self.param.numel() * self.param.element_size()
        host_grads = self.grads.held_bytes(flat_grad)
        return {"grads": grads, "host_grads": host_grads, "host_master_weights": master}


class SwappedMaster(HostMaster):
    """ZeRO-Infinity: master, gradient and optimizer state in swap files (`SwappedState`);
    the step streams them tile by tile. Each reduction is written out as soon as it lands."""

    location = "nvme"
    lands_early = True

    def __init__(
        self,
        space: SwapSpace,
        values: torch.Tensor,
        world: int,
        file: SwapFile | None = None,
        state_dtype: torch.dtype | None = None,
        kind: Fp32Master | Bf16Master | None = None,
    ) -> None:
        self.swapped = SwappedState(space, values, world, file, state_dtype, kind)
        empty = torch.empty(0, dtype=torch.float32, device="cpu")  # the bytes are in the files
        self.param = torch.nn.Parameter(empty, requires_grad=False)
        self.grads = self.swapped.grads
        self._sent = self._landed = False

    def land(self, codec) -> None:
        # Only at the end of backward does every rank know whether any had a gradient:
        # `finish_reduction` commits what is written here.
        if self._landed:
            return
        reduced = codec.finish()
        host = self.swapped.space.buffer(reduced.numel(), torch.float32)  # written out as is
        self.grads.fold_host(host, start_copy(host, reduced), accumulate=True)
        self._landed = True

    def finish_reduction(self, codec, intake, received: bool) -> None:
        self.land(codec)
        self.grads.commit(received)
        self._landed = False

    @property
    def state_dtype(self) -> torch.dtype | None:
        """The dtype of the state's swap files (`SwappedState` keeps it)."""
        return self.swapped.state_dtype

    def values(self) -> torch.Tensor:
        return self.swapped.read_master()

    def adopt_state(self, optimizer: torch.optim.Optimizer) -> None:
        if self.param in optimizer.state:
            self.swapped.write_state(optimizer.state.pop(self.param))  # on disk only

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        return self.swapped.read_state()

    def state_spec(self, optimizer: torch.optim.Optimizer) -> dict[str, tuple[torch.dtype, tuple]]:
        swapped = self.swapped
        spec = {k: (swapped.dtypes[k], (swapped.numel,)) for k in swapped.state_keys}
        return {**spec, **_tensor_spec(swapped.scalars.items())}

    def load(self, master: torch.Tensor, state: dict, optimizer, placement: Placement) -> None:
        self.swapped.write_master(master)
        self.swapped.write_state(state)
        self.send_tile(0, master.numel(), master, placement)  # the parameters follow

    def set_values(self, values: torch.Tensor) -> None:
        self.swapped.write_master(values)

    def updated(self, placement: Placement) -> str | None:
        sent, self._sent = self._sent, False
        return TILES_SENT if sent else None  # not stepped (no gradient anywhere): unchanged

    def held_bytes(self, grads: int, flat_grad) -> dict[str, int]:
        return {"grads": grads, **self.swapped.held_bytes()}


class RoundedToBf16:
    """What a bf16 master (``master_weights_dtype: bf16``) adds to its kind: each bucket's step
    runs in fp32 on a temporary copy of the shard (the gradient, as the optimizer sees it, is
    fp32 too) and is rounded back into the bf16 master stochastically (`ShardRounding`, seeded
    by ``salt`` and the optimizer's step count, so a resumed run rounds as an uninterrupted
    one, and a swapped master's tiles as the whole shard); between steps nothing of it is fp32.
    The gradient is held on an fp32 slot the shape of the shard, which has no memory of its
    own."""

    param: torch.nn.Parameter

    def _round_in_bf16(self, world: int, salt: int) -> None:
        slot = torch.zeros(1, dtype=torch.float32, device=self.param.device)
        slot = slot.expand(self.param.numel())
        self.grads = GradStore(torch.nn.Parameter(slot, requires_grad=False), world)
        self.rounding = ShardRounding(salt)

    @contextmanager
    def stepped(self, optimizer: torch.optim.Optimizer) -> Iterator[torch.nn.Parameter]:
        state = optimizer.state.pop(self.param, {})
        work = torch.nn.Parameter(self.param.detach().float(), requires_grad=False)
        work.grad = self.grads.master.grad
        optimizer.state[work] = _widened(state, work.numel())
        try:
            yield work
        finally:
            state = optimizer.state.pop(work, {})
            keep = self.kept_dtype(optimizer)
            optimizer.state[self.param] = _narrowed_state(state, work.numel(), keep)
            self.rounding.begin_step()
            self.param.detach().copy_(self.rounding.round(work.detach(), state))


class CompactMaster(RoundedToBf16, AliasedMaster):
    """``master_weights_dtype: bf16`` on the device: the master is the parameters' own 16-bit
    values (no fp32 copy: 4 bytes per element less), stepped as `RoundedToBf16` says."""

    def __init__(self, view: torch.Tensor, world: int, complete: bool, salt: int = 0) -> None:
        super().__init__(view, world, complete)
        self._round_in_bf16(world, salt)


class DeviceCompactMaster(RoundedToBf16, DeviceMaster):
    """``master_weights_dtype: bf16`` where the parameters are not in device memory
    (``offload_param``) but the step is: a bf16 copy of the shard on the device (2 bytes per
    element), stepped as `RoundedToBf16` says."""

    def __init__(self, values: torch.Tensor, world: int, salt: int = 0) -> None:
        super().__init__(values.to(torch.bfloat16, copy=True), world)
        self._round_in_bf16(world, salt)


class HostCompactMaster(RoundedToBf16, HostMaster):
    """``master_weights_dtype: bf16`` with ``offload_optimizer: cpu``: the host keeps a bf16
    master (2 bytes per element instead of 4), stepped a bucket at a time as `RoundedToBf16`
    says (`BucketHostStep`); the updated shard is copied to the device after its bucket."""

    def __init__(self, values: torch.Tensor, world: int, pin: bool, salt: int = 0) -> None:
        super().__init__(values, world, pin, torch.bfloat16)
        self._round_in_bf16(world, salt)


def _elementwise(value, numel: int) -> bool:
    return torch.is_tensor(value) and value.is_floating_point() and value.numel() == numel > 1


def _widened(state: dict, numel: int) -> dict:
    """``state`` with its elementwise tensors in fp32 (new tensors; scalars as they are)."""
    return {k: v.float() if _elementwise(v, numel) else v for k, v in state.items()}


def _narrowed_state(state: dict, numel: int, dtype: torch.dtype) -> dict:
    """``state`` with its elementwise tensors in ``dtype`` (kept between steps)."""
    return {k: v.to(dtype) if _elementwise(v, numel) else v for k, v in state.items()}


def _tensor_spec(items) -> dict[str, tuple[torch.dtype, tuple]]:
    return {k: (v.dtype, tuple(v.shape)) for k, v in items if torch.is_tensor(v)}


def master_weights(
    values: torch.Tensor,
    placement: Placement,
    fp32: bool,
    world: int,
    offload: str,
    swap: SwapSpace | None,
    pin: bool,
    compact: bool = False,
    state_dtype: torch.dtype | None = None,
    salt: int = 0,
) -> MasterWeights:
    """The master for one trainable group, from its initial fp32 shard ``values``.
    ``offload``: ``offload_optimizer`` (none, cpu, nvme). ``compact``: the 16-bit parameters
    are the master (``master_weights_dtype: bf16``); ``state_dtype``: elementwise optimizer
    state kept in that dtype between steps (``optimizer_states_dtype: bf16``); ``salt``: this
    shard's part of a 16-bit master's rounding seed (the same in every run of the model)."""
    if offload == "nvme":  # parameters of the master's dtype in a swap file: one file for both
        kind = Bf16Master(ShardRounding(salt)) if compact else Fp32Master()
        file = placement.master_file(swap, kind.dtype)
        return SwappedMaster(swap, values, world, file, state_dtype, kind)
    if offload == "cpu":
        master = (
            HostCompactMaster(values, world, pin, salt)
            if compact
            else HostMaster(values, world, pin)
        )
        master.state_dtype = state_dtype
        return master
    alias = placement.master_view() if fp32 or compact else None
    if alias is not None:
        view, complete = alias
        master = (
            AliasedMaster(view, world, complete)
            if fp32
            else CompactMaster(view, world, complete, salt)
        )
    elif compact:
        master = DeviceCompactMaster(values, world, salt)
    else:
        master = DeviceMaster(values.clone(), world)
    master.state_dtype = state_dtype
    return master
