"""One decision for every rank: what rank 0 found, handed to the others.

Ranks that decide on their own (whether a checkpoint exists, whether a save went through, whether
SIGTERM arrived) can decide differently, and one then waits in a collective the others never
enter. Rank 0 looks, and `agree` gives its answer to every rank.
"""

from __future__ import annotations

from typing import TypeVar

import torch
import torch.distributed as dist

from hf_zero.comm.topology import current_device

T = TypeVar("T")


def agree(value: T) -> T:
    """Rank 0's ``value`` on every rank (collective when the default group has several ranks;
    the value must pickle)."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` is true on any rank (collective: a one-element all-reduce)."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    value = torch.tensor([int(flag)], device=current_device())
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())
