"""Whole stage-3 parameters for the length of a block: for inspection, surgery, custom
initialisation and full state dicts (DeepSpeed's ``GatheredParameters``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch

from hf_zero.sharding.flat_group import FlatParamGroup
from hf_zero.sharding.stage3.coordinator import gather_groups


@contextlib.contextmanager
def gathered(groups: Iterable[FlatParamGroup]) -> Iterator[None]:
    """Gather stage-3 groups exactly (never quantized) for the duration of the block; release
    those it gathered."""
    mine = [g for g in groups if g.stage == 3 and g.flat_param is None]
    gather_groups(mine, exact=True)
    try:
        yield
    finally:
        for g in mine:
            g.release()


@contextlib.contextmanager
def gathered_parameters(params, modifier_rank: int | None = None) -> Iterator[None]:
    """Make parameters whole for the block: for inspection, surgery or custom initialisation.

    Works for every stage (under stages 0-2 parameters are whole already). If
    ``modifier_rank`` is given, that rank's values at the end of the block are broadcast to the
    others and written back into the shards and the fp32 master weights, so the change survives
    the next optimizer step. Without it, changes are discarded (stage 3) or left unsynchronised.
    Collective: every rank must enter the block with the same parameters.
    """
    params = list(params)
    groups = list(dict.fromkeys(g for p in params if (g := _group_of(p)) is not None))
    with gathered(groups):
        yield
        if modifier_rank is not None:
            with torch.no_grad():
                for group in groups:
                    group.broadcast_from(modifier_rank)


def _group_of(param: torch.Tensor) -> FlatParamGroup | None:
    return getattr(param, "_hf_zero_group", None)
