"""Trainer checkpoints that are complete or absent: staged, then published by one rename.

The Trainer writes ``checkpoint-N`` piece by piece (weights, the engine's shards, scheduler,
RNG states, ``trainer_state.json``), and transformers' ``get_last_checkpoint()`` (what
``resume_from_checkpoint=True`` and most scripts use) picks the highest ``checkpoint-N`` folder
whatever it holds. So under hf_zero the Trainer writes the checkpoint into
``<output_dir>/.hf_zero-staging/checkpoint-N`` instead; when every rank has finished, the saving
rank renames it to ``<output_dir>/checkpoint-N`` (one directory rename, atomic on a POSIX file
system) and only then rotates old checkpoints. A save killed at any moment leaves the staging
folder, which nothing takes for a checkpoint and the next save or run removes; a failed save
(a full disk) raises an error naming the folder and the space, and leaves the previous
checkpoints as they were.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from hf_zero.checkpoint.publish import fsync_path
from hf_zero.storage.disk_space import no_space_error

logger = logging.getLogger(__name__)

STAGING = ".hf_zero-staging"
"""Folder under the run's output directory where a checkpoint is written before it is published."""


def remove_debris(run_dir: str | os.PathLike) -> None:
    """Remove what an interrupted save left (the staging folder), logging what it held."""
    staging = Path(run_dir) / STAGING
    if staging.exists():
        left = sorted(p.name for p in staging.iterdir())
        logger.warning("hf_zero: removing an interrupted checkpoint save: %s %s", staging, left)
        shutil.rmtree(staging, ignore_errors=True)


def save_staged(trainer, trial, save: Callable[[], None]) -> None:
    """Run the Trainer's own ``_save_checkpoint`` (``save``) into the staging folder, then
    publish the checkpoint by renaming it into place (collective: every rank calls it)."""
    run_dir = trainer._get_output_dir(trial=trial)
    name = f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}"
    staging = os.path.join(run_dir, STAGING)
    if trainer.args.should_save:
        remove_debris(run_dir)
    trainer.accelerator.wait_for_everyone()
    trainer._get_output_dir = lambda trial=None: staging
    try:
        save()
    except OSError as error:
        if trainer.args.should_save:
            shutil.rmtree(staging, ignore_errors=True)  # give the space back at once
        if error.errno != errno.ENOSPC:
            raise
        previous = Path(run_dir).glob(f"{PREFIX_CHECKPOINT_DIR}-*")
        raise no_space_error(error, run_dir, previous) from error
    finally:
        del trainer._get_output_dir
    trainer.accelerator.wait_for_everyone()  # every rank's files are written
    best = trainer.state.best_model_checkpoint
    moved = best is not None and Path(best).parent.name == STAGING
    if moved:  # the Trainer recorded the staged path: every rank keeps the published one
        trainer.state.best_model_checkpoint = os.path.join(run_dir, Path(best).name)
    if trainer.args.should_save:
        staged = Path(staging) / name
        if moved:
            trainer.state.save_to_json(str(staged / "trainer_state.json"))
        _publish(trainer, staged, Path(run_dir) / name)
    trainer.accelerator.wait_for_everyone()


def _publish(trainer, staged: Path, final: Path) -> None:
    """Give the staged checkpoint its name, and rotate old ones as the Trainer would."""
    _fsync_tree(staged)
    if final.exists():  # the same step saved again: the old one goes once the new one is in
        os.replace(final, staged.parent / f"replaced-{final.name}")
    os.replace(staged, final)
    fsync_path(final.parent)
    shutil.rmtree(staged.parent, ignore_errors=True)
    rotate_checkpoints(
        output_dir=str(final.parent),
        save_total_limit=trainer.args.save_total_limit,
        best_model_checkpoint=trainer.state.best_model_checkpoint,
        use_mtime=True,
    )


def _fsync_tree(path: Path) -> None:
    """Flush every file and folder of ``path`` to disk before the rename publishes it."""
    for p in sorted(path.rglob("*"), reverse=True):
        if p.is_file() or p.is_dir():
            fsync_path(p)
    fsync_path(path)


def record_saved_dtype(model, dtype: torch.dtype | None, output_dir: str) -> None:
    """Make ``config.json``'s ``dtype`` that of the weights written (``dtype``):
    ``save_pretrained`` takes it from the parameters, which hold the training precision."""
    path = os.path.join(output_dir, "config.json")
    if dtype is None or not os.path.exists(path) or getattr(model, "config", None) is None:
        return
    model.config.dtype = str(dtype).removeprefix("torch.")
    model.config.save_pretrained(output_dir)
