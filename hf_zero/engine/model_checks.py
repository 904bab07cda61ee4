"""What `initialize` checks of the model before any collective moves its tensors: every
parameter is materialised, and every rank built the same model.

Ranks that built different models (another config, another checkpoint's architecture, a
branch on the rank) otherwise fail much later and far from the cause: a collective of two sizes
aborts the process, one more layer hangs until the timeout. So each rank hashes its parameters'
names, shapes, dtypes and trainability; one all-gather of the 32-byte digests compares them, and
only when they differ are the lists themselves gathered, to name the first difference.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from hf_zero.sharding.stage3.units import whole_shape

if TYPE_CHECKING:
    from hf_zero.comm import Collectives
    from hf_zero.comm.topology import Group


def check_materialized(model: torch.nn.Module) -> None:
    """A parameter still on the meta device (built without weights and never loaded) is named,
    instead of failing later in a copy with torch's ``Cannot copy out of meta tensor``."""
    meta = [name for name, p in model.named_parameters() if p.is_meta]
    if meta:
        raise ValueError(
            f"hf_zero: {len(meta)} parameter(s) are on the meta device (built without weights and "
            f"never loaded): {meta[:5]}. Load their weights (from_pretrained, load_state_dict "
            "with assign=True, or hf_zero.partitioned_init() + load_partitioned) before initialize"
        )


def describe(model: torch.nn.Module) -> list[tuple[str, list[int], str, bool]]:
    """``(name, whole shape, dtype, trainable)`` of every parameter, in registration order."""
    return [
        (name, list(whole_shape(p)), str(p.dtype).removeprefix("torch."), p.requires_grad)
        for name, p in model.named_parameters()
    ]


def check_same_model(
    model: torch.nn.Module, comm: Collectives, world: Group, device: torch.device
) -> None:
    """Raise the same ``ValueError`` on every rank unless every rank's model has the same
    parameters (collective over ``world``, booked in ``comm`` as control traffic)."""
    if world.size == 1:
        return
    mine = describe(model)
    digest = hashlib.sha256(json.dumps(mine).encode()).digest()
    local = torch.frombuffer(bytearray(digest), dtype=torch.uint8).to(device)
    gathered = torch.empty(world.size * len(digest), dtype=torch.uint8, device=device)
    comm.for_purpose("control").all_gather_native(gathered, local, world)
    digests = gathered.view(world.size, -1).cpu()
    if all(torch.equal(digests[0], d) for d in digests[1:]):
        return
    every: list = [None] * world.size
    dist.all_gather_object(every, mine, group=world.pg)
    raise ValueError(_first_difference(every))


def _first_difference(every: list[list]) -> str:
    reference = every[0]
    for rank, other in enumerate(every[1:], start=1):
        for i in range(max(len(reference), len(other))):
            ours = reference[i] if i < len(reference) else None
            theirs = other[i] if i < len(other) else None
            if ours != theirs:
                differing = [r for r, o in enumerate(every) if o != reference]
                return (
                    "hf_zero: the ranks built different models (ranks "
                    f"{differing} differ from rank 0). First difference, parameter #{i}: "
                    f"rank 0 has {_show(ours)}, rank {rank} has {_show(theirs)}. Every rank "
                    "must build the same model from the same config and checkpoint"
                )
    return "hf_zero: the ranks built different models"


def _show(entry) -> str:
    if entry is None:
        return "no such parameter"
    name, shape, dtype, trainable = entry
    return f"'{name}' {tuple(shape)} {dtype}{' trainable' if trainable else ' frozen'}"
