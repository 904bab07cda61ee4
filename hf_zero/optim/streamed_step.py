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
gives it - the bits equal plain ZeRO-3's. Offloaded Adam/AdamW may instead take torch's fused CPU
kernel (`adam_step`), as ``offload_optimizer: cpu`` does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hf_zero.optim.cpu_adam import adam_step
from hf_zero.sharding.swapped_state import SwappedState

DEFAULT_TILE = 1 << 22  # elements: 16 MiB per fp32 tensor per buffer set


class _Tile:
    """One buffer set: a tile's tensors, its reads and the writes that must end before reuse."""

    def __init__(self, state: SwappedState, keys: list[str], numel: int) -> None:
        self.buffers = {k: state.space.buffer(numel, state.dtypes[k]) for k in keys}
        self.reads: list = []
        self.writes: list = []
        self.range = (0, 0)

    def load(self, state: SwappedState, keys: list[str], start: int, end: int) -> None:
        self.drain()
        self.range = (start, end)
        for key in keys:
            view = self.buffers[key][: end - start]
            offset = start * view.element_size()
            self.reads.append(state.files[key].read_async(view, offset))

    def ready(self) -> dict[str, torch.Tensor]:
        for done in self.reads:
            done.result()
        self.reads = []
        start, end = self.range
        return {k: b[: end - start] for k, b in self.buffers.items()}

    def store(self, state: SwappedState, keys: list[str]) -> None:
        start, end = self.range
        for key in keys:
            view = self.buffers[key][: end - start]
            self.writes.append(state.files[key].write_async(view, start * view.element_size()))

    def drain(self) -> None:
        for done in self.reads + self.writes:
            done.result()
        self.reads, self.writes = [], []


def streamed_step(
    optimizer: torch.optim.Optimizer,
    groups: list,
    fast_kernel: bool,
    on_tile: Callable[[object, int, int, torch.Tensor], None],
    tile_numel: int = DEFAULT_TILE,
    buffer_count: int = 4,
) -> None:
    """Step every NVMe-offloaded group in ``groups`` that has a gradient, tile by tile.

    ``on_tile(group, start, end, values)`` receives each updated master tile (to write the
    16-bit parameters) before its buffers are reused.
    """
    param_groups = optimizer.param_groups
    members = [pg["params"] for pg in param_groups]
    try:
        for group in groups:
            state = group.swapped
            if state is None or not state.grads.present:
                continue
            state.grads.settle()
            param_group = param_groups[group.param_group_index]
            _step_group(optimizer, param_group, group, fast_kernel, on_tile, tile_numel,
                        buffer_count)  # fmt: skip
    finally:
        optimizer.param_groups = param_groups
        for pg, params in zip(param_groups, members):
            pg["params"] = params


def _step_group(optimizer, param_group, group, fast_kernel, on_tile, tile_numel, buffer_count):
    state: SwappedState = group.swapped
    numel = state.numel
    tile = min(tile_numel, numel)
    # On the group's first step every tile starts from empty state, as torch's optimizers do
    # for a new parameter; the state tensors they create get their files after the first tile.
    initial = not state.state_keys
    read_keys = ["master", "grad", *state.state_keys]
    factors = state.grads.factors
    bounds = [(s, min(s + tile, numel)) for s in range(0, numel, tile)]
    ring = [_Tile(state, read_keys, tile) for _ in range(min(buffer_count, len(bounds)))]
    for k, slot in enumerate(ring):
        slot.load(state, read_keys, *bounds[k])
    new_scalars = state.scalars
    for k, (start, end) in enumerate(bounds):
        slot = ring[k % len(ring)]
        tensors = slot.ready()
        param = torch.nn.Parameter(tensors["master"], requires_grad=False)
        param.grad = tensors["grad"]
        for factor in factors:
            param.grad.mul_(factor)
        tile_state = {} if initial else {key: tensors[key] for key in state.state_keys}
        for key, value in state.scalars.items():
            tile_state[key] = value.clone() if torch.is_tensor(value) else value
        optimizer.state[param] = tile_state
        param_group["params"] = [param]
        optimizer.param_groups = [param_group]
        try:
            adam_step(optimizer) if fast_kernel else optimizer.step()
        finally:
            new_state = optimizer.state.pop(param, {})
        if initial:
            if k == 0:
                _adopt_keys(state, new_state, end - start, ring)
            for key in state.state_keys:
                slot.buffers[key][: end - start].copy_(new_state[key].reshape(-1))
        new_scalars = {key: v for key, v in new_state.items() if key not in state.state_keys}
        on_tile(group, start, end, tensors["master"])
        slot.store(state, ["master", *state.state_keys])
        if k + len(ring) < len(bounds):
            slot.load(state, read_keys, *bounds[k + len(ring)])
    for slot in ring:
        slot.drain()
    state.scalars = new_scalars
    state.grads.clear()


def _adopt_keys(state: SwappedState, new_state: dict, tile: int, ring: list[_Tile]) -> None:
    """After the first tile's first step: give each elementwise state tensor a file and a
    buffer in every set (later tiles read them like the master)."""
    for key, value in new_state.items():
        if torch.is_tensor(value) and value.dim() > 0 and value.numel() == tile:
            state.add_key(key, value.dtype)
            for slot in ring:
                size = slot.buffers["master"].numel()
                slot.buffers[key] = state.space.buffer(size, value.dtype)
