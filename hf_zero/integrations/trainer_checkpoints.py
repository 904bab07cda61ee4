"""Trainer checkpoints that are complete or absent: staged, checked, then published by one rename.

The Trainer writes ``checkpoint-N`` piece by piece (weights, the engine's shards, scheduler,
RNG states, ``trainer_state.json``), and transformers' ``get_last_checkpoint()`` (what
``resume_from_checkpoint=True`` and most scripts use) picks the highest ``checkpoint-N`` folder
whatever it holds. So under hf_zero the Trainer writes the checkpoint into this run's own
staging folder, ``<output_dir>/.hf_zero-staging/<owner>/checkpoint-N`` (the owner: the saving
rank's host, pid and start time). When every rank has finished, the saving rank checks that
every part a resume needs is there, writes the manifest (`hf_zero.checkpoint.manifest`), renames
the folder to ``<output_dir>/checkpoint-N`` (one directory rename, atomic on a POSIX file
system) and only then rotates old checkpoints. A save killed at any moment leaves only the
staging folder, which nothing takes for a checkpoint; a run removes its own staging folder at
each save and, at start, those of runs that have ended - never a live run's. A failed save (a
full disk) raises an error naming the folder and the space, and leaves the previous
checkpoints as they were. A checkpoint that another run wrote is never replaced.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from hf_zero.checkpoint.format import is_complete
from hf_zero.checkpoint.manifest import manifest_problems, read_manifest, write_manifest
from hf_zero.checkpoint.publish import fsync_path
from hf_zero.integrations.agreement import agree
from hf_zero.storage.disk_space import no_space_error
from hf_zero.storage.owners import Owner

logger = logging.getLogger(__name__)

STAGING = ".hf_zero-staging"
"""Folder under the run's output directory where checkpoints are written before they are
published, one sub-folder per run."""
ZERO_DIR = "zero"
"""The engine's sharded checkpoint inside a Trainer checkpoint directory."""
_STEP = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
_WEIGHTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "adapter_model.safetensors",
    "adapter_model.bin",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def remove_dead_staging(run_dir: str | os.PathLike) -> None:
    """Remove the staging folders of runs that have ended (logged with what they held); a live
    run's, or one on another host, stays."""
    staging = Path(run_dir) / STAGING
    if not staging.is_dir():
        return
    for folder in sorted(staging.iterdir()):
        owner = Owner.parse(folder.name)
        if owner is not None and owner.alive():
            continue
        left = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
        logger.warning("hf_zero: removing an interrupted checkpoint save: %s %s", folder, left)
        shutil.rmtree(folder, ignore_errors=True)
        if folder.is_file():
            folder.unlink()
    if not any(staging.iterdir()):
        staging.rmdir()


def save_staged(trainer, trial, save: Callable[[], None], run) -> None:
    """Run the Trainer's own ``_save_checkpoint`` (``save``) into ``run``'s staging folder, then
    publish the checkpoint by renaming it into place (collective: every rank calls it).

    ``run`` is the `hf_zero.integrations.run_claim.RunClaim` of this training run (its staging
    folder's name and run id, the same on every rank)."""
    run_dir = trainer._get_output_dir(trial=trial)
    step = trainer.state.global_step
    name = f"{PREFIX_CHECKPOINT_DIR}-{step}"
    staging = os.path.join(run_dir, STAGING, run.owner_name)
    final = Path(run_dir) / name
    refusal = None
    if trainer.args.should_save:
        _drop(staging)  # this run's own interrupted save
        refusal = _foreign(final, run.run_id)
    refusal = agree(refusal)
    if refusal:
        raise RuntimeError(refusal)
    trainer._get_output_dir = lambda trial=None: staging
    try:
        save()
    except OSError as error:
        if trainer.args.should_save:
            _drop(staging)  # give the space back at once
        if error.errno != errno.ENOSPC:
            raise
        previous = Path(run_dir).glob(f"{PREFIX_CHECKPOINT_DIR}-*")
        raise no_space_error(error, run_dir, previous) from error
    finally:
        del trainer._get_output_dir
    trainer.accelerator.wait_for_everyone()  # every rank's files are written
    best = trainer.state.best_model_checkpoint
    moved = best is not None and Path(best).parent == Path(staging)
    if moved:  # the Trainer recorded the staged path: every rank keeps the published one
        trainer.state.best_model_checkpoint = os.path.join(run_dir, Path(best).name)
    problem = None
    if trainer.args.should_save:
        staged = Path(staging) / name
        if moved:
            trainer.state.save_to_json(str(staged / "trainer_state.json"))
        missing = missing_parts(staged, trainer)
        if missing:
            _drop(staging)
            problem = (
                f"hf_zero: the checkpoint {name} under {run_dir} came out incomplete (missing: "
                f"{', '.join(missing)}), so it was not published; the previous checkpoints are "
                "untouched"
            )
        else:
            write_manifest(staged, run.run_id, step)
            _publish(trainer, staged, final)
    problem = agree(problem)
    if problem:
        raise RuntimeError(problem)


def missing_parts(folder: Path, trainer, rng: bool = True) -> list[str]:
    """What a Trainer checkpoint folder lacks for a resume: its state, weights and - unless
    ``save_only_model`` - the engine's shards, the scheduler and (``rng``) every rank's RNG
    state."""
    missing = []
    if not (folder / "trainer_state.json").is_file():
        missing.append("trainer_state.json")
    weights = [w for w in _WEIGHTS if (folder / w).is_file()]
    if not weights:
        missing.append("the model's weights (model.safetensors or adapter_model.safetensors)")
    for index in (w for w in weights if w.endswith(".index.json")):
        shards = set(json.loads((folder / index).read_text())["weight_map"].values())
        missing += sorted(s for s in shards if not (folder / s).is_file())
    if getattr(trainer.args, "save_only_model", False):
        return missing
    if not is_complete(folder / ZERO_DIR):
        missing.append(f"{ZERO_DIR}/ (the engine's shards)")
    if not (folder / "scheduler.pt").is_file():
        missing.append("scheduler.pt")
    world = trainer.args.world_size
    states = ["rng_state.pth"] if world <= 1 else [f"rng_state_{r}.pth" for r in range(world)]
    missing += [f for f in states if rng and not (folder / f).is_file()]
    return missing


def checkpoint_step(folder: Path) -> int | None:
    """N of a ``checkpoint-N`` folder name, else ``None``."""
    match = _STEP.match(folder.name)
    return int(match.group(1)) if match else None


def latest_complete(run_dir: str | os.PathLike, trainer) -> Path | None:
    """The highest-step ``checkpoint-N`` of ``run_dir`` that checks out against its manifest
    (or, written without one, holds every part `missing_parts` asks for); those skipped are
    logged with the reason."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return None
    found = [(checkpoint_step(p), p) for p in run_dir.iterdir() if p.is_dir()]
    for _, folder in sorted(((s, p) for s, p in found if s is not None), reverse=True):
        if read_manifest(folder) is not None:
            problems = manifest_problems(folder)
        else:
            problems = missing_parts(folder, trainer, rng=False)  # saved at another world size?
        if not problems:
            return folder
        logger.warning("hf_zero: skipping incomplete checkpoint %s: %s", folder, problems)
    return None


def checkpoints_of_other_runs(run_dir: str | os.PathLike, run_id: str) -> list[str]:
    """The ``checkpoint-N`` folders of ``run_dir`` that another run wrote (or no known run)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [p for p in run_dir.iterdir() if p.is_dir() and checkpoint_step(p) is not None]
    foreign = [p for p in found if (read_manifest(p) or {}).get("run_id") != run_id]
    return [p.name for p in sorted(foreign, key=checkpoint_step)]


def _foreign(final: Path, run_id: str) -> str | None:
    if not final.exists() or (read_manifest(final) or {}).get("run_id") == run_id:
        return None
    return (
        f"hf_zero: {final} exists and was written by another run; this run does not replace "
        "it (resume that run with --resume_from_checkpoint auto, or use another --output_dir)"
    )


def _publish(trainer, staged: Path, final: Path) -> None:
    """Give the staged checkpoint its name, and rotate old ones as the Trainer would."""
    _fsync_tree(staged)
    if final.exists():  # this run saved the same step again: the old one goes once the new is in
        os.replace(final, staged.parent / f"replaced-{final.name}")
    os.replace(staged, final)
    fsync_path(final.parent)
    _drop(staged.parent)
    rotate_checkpoints(
        output_dir=str(final.parent),
        save_total_limit=trainer.args.save_total_limit,
        best_model_checkpoint=trainer.state.best_model_checkpoint,
        use_mtime=True,
    )


def _drop(staging: str | os.PathLike) -> None:
    """Remove this run's staging folder, and the staging parent once no run has one there."""
    staging = Path(staging)
    shutil.rmtree(staging, ignore_errors=True)
    with contextlib.suppress(OSError):  # not empty: another (ended) run's folder is left
        staging.parent.rmdir()


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
