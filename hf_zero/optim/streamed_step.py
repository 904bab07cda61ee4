"""The optimizer step over NVMe-resident state, streamed tile by tile (ZeRO-Infinity).

For each group with a gradient, the master shard, its gradient and every state tensor are read
in tiles of ``tile_numel`` elements into one of ``buffer_count`` aligned buffer sets. While tile
``k`` is updated, the reads of tiles ``k+1 .. k+buffer_count-1`` are in flight on the I/O threads
and the writes of the tiles before it drain; a buffer set is reused only once its writes are
done. Memory held: ``buffer_count`` sets of (master, gradient, state...) tiles, whatever the model
size.

Each tile is stepped by the user's optimizer itself, on a temporary parameter holding the tile
(``param_groups`` narrowed to it, its state the tile's slices plus the shared scalars): the
supported optimizers are elementwise, so every element gets exactly the update a whole-shard step
gives it - the bits equal plain ZeRO-3's. A bf16 master's tile is stepped on an fp32 copy and
rounded back with the bits its position draws (`hf_zero.numerics.rounding`), as the device's
bf16 master is rounded whole. Offloaded Adam/AdamW may instead take torch's fused CPU
kernel (`adam_step`), as ``offload_optimizer: cpu`` does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hf_zero.observe import clock
from hf_zero.optim.cpu_adam import adam_step
from hf_zero.sharding.swapped_state import SwappedState
from hf_zero.storage.swap import ALIGN

DEFAULT_TILE = 1 << 22  # elements: 16 MiB per fp32 tensor per buffer set


class _Tile:
    """One buffer set: a tile's tensors, its reads and the writes that must end before reuse."""

    def __init__(self, numel: int) -> None:
        self.numel = numel
        self.buffers: dict[str, torch.Tensor] = {}
        self.reads: list = []
        self.writes: list = []
        self.range = (0, 0)

    def load(self, state: SwappedState, keys: list[str], start: int, end: int) -> None:
        self.drain()
        self.range = (start, end)
        for key in keys:
            view = self.view(state, key)
            self.reads.append(state.files[key].read_async(view, start * view.element_size()))

    def view(self, state: SwappedState, key: str) -> torch.Tensor:
        """This set's buffer for ``key`` (made on first use), cut to the tile."""
        buffer = self.buffers.get(key)
        if buffer is None or buffer.dtype != state.dtypes[key]:
            buffer = self.buffers[key] = state.space.buffer(self.numel, state.dtypes[key])
        start, end = self.range
        return buffer[: end - start]

    def ready(self) -> None:
        for done in self.reads:
            clock.waited("disk_io", done)
        self.reads = []

    def store(self, state: SwappedState, keys: list[str]) -> None:
        start = self.range[0]
        for key in keys:
            view = self.view(state, key)
            self.writes.append(state.files[key].write_async(view, start * view.element_size()))

    def drain(self) -> None:
        for done in self.reads + self.writes:
            clock.waited("disk_io", done)
        self.reads, self.writes = [], []


class _GroupStep:
    """One group's part of the step: its tiles, and what its first tile learns."""

    def __init__(self, group, param_group: dict, tile_numel: int) -> None:
        self.group = group
        self.state: SwappedState = group.swapped
        self.param_group = param_group
        numel = self.state.numel
        self.tile = min(tile_numel, numel)
        self.bounds = [(s, min(s + self.tile, numel)) for s in range(0, numel, self.tile)]
        # On the group's first step every tile starts from empty state, as torch's optimizers
        # do for a new parameter; the state tensors get their files after the first tile.
        self.initial = not self.state.state_keys
        self.read_keys = ["master", "grad", *self.state.state_keys]
        self.scalars = self.state.scalars


def streamed_step(
    optimizer: torch.optim.Optimizer,
    groups: list,
    fast_kernel: bool,
    on_tile: Callable[[object, int, int, torch.Tensor], None],
    tile_numel: int | None = None,
    buffer_count: int = 4,
) -> None:
    """Step every NVMe-offloaded group in ``groups`` that has a gradient, tile by tile
    (``tile_numel`` elements each, `DEFAULT_TILE` unless given).

    The tiles of all groups form one pipeline: the reads of the next group's first tiles are in
    flight while the last tiles of this one are stepped (a group of one or two tiles would
    otherwise leave the disk idle at every group boundary). ``on_tile(group, start, end,
    values)`` receives each updated master tile (to write the parameters) before its buffers
    are reused.
    """
    tile_numel = tile_numel or DEFAULT_TILE
    if tile_numel % 1024:
        raise ValueError(
            f"hf_zero: a streamed step's tile is {tile_numel} elements; it must be a multiple "
            "of 1024 (whole 4 KiB blocks of fp32, as O_DIRECT reads and writes them)"
        )
    param_groups = optimizer.param_groups
    members = [pg["params"] for pg in param_groups]
    try:
        work = []
        for group in groups:
            state = group.swapped
            if state is None or not state.grads.present:
                continue
            for dtype in {state.state_dtype, state.master_kind.dtype} - {None}:
                if tile_numel * dtype.itemsize % ALIGN:
                    raise ValueError(
                        f"hf_zero: a streamed step's tile is {tile_numel} elements; with "
                        f"{dtype} in swap files it must be whole {ALIGN}-byte blocks of it"
                    )
            state.grads.settle()
            work.append(_GroupStep(group, param_groups[group.param_group_index], tile_numel))
        if work:
            _run(optimizer, work, fast_kernel, on_tile, buffer_count)
    finally:
        optimizer.param_groups = param_groups
        for pg, params in zip(param_groups, members):
            pg["params"] = params


def _run(optimizer, work: list[_GroupStep], fast_kernel, on_tile, buffer_count: int) -> None:
    tiles = [(step, k, *bounds) for step in work for k, bounds in enumerate(step.bounds)]
    ring = [_Tile(max(s.tile for s in work)) for _ in range(min(buffer_count, len(tiles)))]
    for slot, (step, _, start, end) in zip(ring, tiles):
        slot.load(step.state, step.read_keys, start, end)
    for i, (step, k, start, end) in enumerate(tiles):
        slot = ring[i % len(ring)]
        slot.ready()
        state = step.state
        master = slot.view(state, "master")
        if k == 0:
            state.master_kind.begin_step()
        param = torch.nn.Parameter(state.master_kind.widened(master), requires_grad=False)
        param.grad = slot.view(state, "grad")
        for factor in state.grads.factors:
            param.grad.mul_(factor)
        # The optimizer steps fp32 state: a tile kept in bf16 is widened (a copy), an fp32 one
        # is stepped in its buffer.
        tile_state = (
            {} if step.initial else {key: slot.view(state, key).float() for key in state.state_keys}
        )
        for key, value in state.scalars.items():
            tile_state[key] = value.clone() if torch.is_tensor(value) else value
        optimizer.state[param] = tile_state
        step.param_group["params"] = [param]
        optimizer.param_groups = [step.param_group]
        try:
            adam_step(optimizer) if fast_kernel else optimizer.step()
        finally:
            new_state = optimizer.state.pop(param, {})
        if step.initial and k == 0:
            _adopt_keys(state, new_state, end - start)
        for key in state.state_keys:  # new or widened state into the buffers (rounded to bf16)
            view = slot.view(state, key)
            if new_state[key].data_ptr() != view.data_ptr():
                view.copy_(new_state[key].reshape(-1))
        step.scalars = {key: v for key, v in new_state.items() if key not in state.state_keys}
        state.master_kind.narrow(master, param.detach(), new_state, start)
        on_tile(step.group, start, end, master)
        slot.store(state, ["master", *state.state_keys])
        if i + len(ring) < len(tiles):
            following, _, lo, hi = tiles[i + len(ring)]
            slot.load(following.state, following.read_keys, lo, hi)
    for slot in ring:
        slot.drain()
    for step in work:
        step.state.scalars = step.scalars
        step.state.grads.clear()


def _adopt_keys(state: SwappedState, new_state: dict, tile: int) -> None:
    """After the first tile's first step: give each elementwise state tensor a file (later
    tiles read and write it like the master; the buffer sets make its buffers on first use)."""
    for key, value in new_state.items():
        if torch.is_tensor(value) and value.dim() > 0 and value.numel() == tile:
            state.add_key(key, state.kept_dtype(value))
