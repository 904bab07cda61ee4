"""A save that fails on one rank fails on every rank, together, and says why once."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hf_zero.comm.topology import current_device
from hf_zero.storage.disk_space import save_failed_error

if TYPE_CHECKING:
    from hf_zero.engine.state_view import EngineState


def agree_on_failure(
    engine: EngineState,
    failure: Exception | None,
    nbytes: int,
    folder: Path,
    partial: Path | None,
) -> None:
    """Collective: every rank learns whether any rank failed to write its part (``failure``;
    ``nbytes``: what this rank's part needs). If one did, rank 0 removes ``partial`` (a staging
    folder or a ``.partial`` file, never anything published) and every rank raises
    `save_failed_error`. Also a barrier: a rank that died never gets past here."""
    row = torch.tensor(
        [failure is not None, getattr(failure, "errno", None) or 0, nbytes],
        dtype=torch.int64, device=current_device(),
    )  # fmt: skip
    world = engine.topology.world
    table = row.new_empty(world.size * 3)
    engine.comm.for_purpose("control").all_gather_native(table, row, world)
    rows = table.view(world.size, 3).tolist()
    failed = [r for r, (bad, _, _) in enumerate(rows) if bad]
    if not failed:
        return
    if engine.topology.rank == 0 and partial is not None:  # give the space back at once
        if partial.is_dir():
            shutil.rmtree(partial, ignore_errors=True)
        else:
            partial.unlink(missing_ok=True)
    code = next(code for bad, code, _ in rows if bad)
    needed = sum(n for _, _, n in rows)
    raise save_failed_error(
        failed, code, needed, folder, failure, engine.topology.rank
    ) from failure
