"""Where a Trainer run starts, and its claim on the output folder, decided once before training.

``--resume_from_checkpoint`` takes, besides a folder, ``true`` (the latest complete checkpoint;
an error when there is none, as in transformers), ``false`` and ``auto``: the latest complete
checkpoint if there is one, a fresh start otherwise, so one command serves a first start and
every restart. Under a restarting launcher (torchrun ``--max-restarts``, ``accelerate launch
--max_restarts``: ``TORCHELASTIC_RESTART_COUNT`` > 0) a restarted round resumes from the latest
complete checkpoint of its output folder whatever the flag says, as torchelastic expects of the
application. Rank 0 decides, says so on stderr, and every rank follows it (`agree`).

Before it trains, a run also takes the output folder (`hf_zero.checkpoint.run_lock`: a second
live run there is refused, naming the first), removes the staging folders of ended runs, and
refuses a fresh start where another run's checkpoints lie, which its own saves would replace.
"""

from __future__ import annotations

import os
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

from hf_zero.checkpoint.manifest import manifest_problems, read_manifest
from hf_zero.checkpoint.run_lock import OutputDirBusy, RunLock
from hf_zero.comm.elastic import RESTART_COUNT, restart_count
from hf_zero.integrations.agreement import agree
from hf_zero.integrations.start_checks import StartRefused
from hf_zero.integrations.trainer_checkpoints import (
    checkpoint_step,
    checkpoints_of_other_runs,
    latest_complete,
    remove_dead_staging,
)

AUTO = "auto"


class RunRefused(StartRefused):
    """The run cannot start in this output folder (the message says why and what to do)."""


@dataclass(frozen=True)
class RunClaim:
    """A training run's hold on its output folder, the same on every rank."""

    owner_name: str
    """Its staging folder's name (`hf_zero.storage.owners.Owner.name` of the saving rank)."""
    run_id: str
    """Written into every checkpoint's manifest; a resumed run keeps the id it resumed."""
    resume: str | bool | None
    """What ``Trainer.train`` is given: a checkpoint folder, ``True`` (none found: transformers
    raises its own error) or ``None`` (from step 0)."""


def claim_run(trainer, requested, previous: RunClaim | None = None) -> RunClaim:
    """Take ``trainer.args.output_dir`` for this run and decide where it starts (collective).

    ``requested`` is ``train(resume_from_checkpoint=...)``; ``previous`` the claim of an earlier
    ``train()`` of the same trainer. Raises `RunRefused` on every rank when rank 0 refuses.
    """
    decision: tuple[str | None, RunClaim | None] = (None, None)
    if trainer.args.process_index == 0:
        try:
            decision = (None, _decide(trainer, requested, previous))
        except (RunRefused, OutputDirBusy) as refusal:
            decision = (str(refusal), None)
    error, claim = agree(decision)
    if error:
        raise RunRefused(error)
    return claim


def _decide(trainer, requested, previous: RunClaim | None) -> RunClaim:
    output_dir = Path(trainer.args.output_dir)
    lock = RunLock.acquire(output_dir)
    remove_dead_staging(output_dir)
    resume = _resume_point(trainer, _flag(requested), output_dir)
    if isinstance(resume, str):
        _verify(Path(resume))
        manifest = read_manifest(Path(resume)) or {}
        run_id = manifest.get("run_id") or uuid.uuid4().hex
    else:
        run_id = previous.run_id if previous is not None else uuid.uuid4().hex
    if resume is None:
        others = checkpoints_of_other_runs(output_dir, run_id)
        if others:
            raise RunRefused(
                f"hf_zero: --output_dir {output_dir} holds checkpoints of another run "
                f"({', '.join(others)}) and this run starts from step 0, so its saves would "
                "replace them: continue that run with --resume_from_checkpoint auto, or use "
                "another --output_dir (or remove them)"
            )
    return RunClaim(lock.owner.name, run_id, resume)


def _verify(checkpoint: Path) -> None:
    """Every byte of the checkpoint a run resumes from, against its manifest (checkpoints
    written without one are checked by the engine's own shard checksums only)."""
    if read_manifest(checkpoint) is None:
        return
    problems = manifest_problems(checkpoint, checksums=True)
    if problems:
        raise RunRefused(
            f"hf_zero: cannot resume from {checkpoint}: {'; '.join(problems)}. Resume from an "
            "earlier checkpoint (--resume_from_checkpoint <folder>), or remove this one"
        )


def _resume_point(trainer, requested, output_dir: Path) -> str | bool | None:
    rounds = restart_count()
    if rounds > 0:
        latest = latest_complete(output_dir, trainer)
        if latest is not None and not _newer(requested, latest):
            _say(
                f"restart round {rounds} of the launch ({RESTART_COUNT}={rounds}): resuming from "
                f"{latest}, the latest complete checkpoint (step {checkpoint_step(latest)})"
            )
            return str(latest)
        if not isinstance(requested, str):
            _say(f"restart round {rounds}: no complete checkpoint in {output_dir}; from step 0")
            return None
        _say(f"restart round {rounds}: resuming from {requested}, as asked")
        return requested
    if requested == AUTO or requested is True:
        latest = latest_complete(output_dir, trainer)
        if latest is not None:
            _say(f"resuming from {latest}, the latest complete checkpoint in {output_dir}")
            return str(latest)
        if requested is True:
            return True  # transformers: "No valid checkpoint found in output directory"
        _say(f"no checkpoint in {output_dir} yet: starting from step 0")
        return None
    return requested or None


def _newer(requested, latest: Path) -> bool:
    """Whether the folder the user named is a later step than ``latest``."""
    if not isinstance(requested, str) or requested == AUTO:
        return False
    step = checkpoint_step(Path(requested))
    return step is not None and step > (checkpoint_step(latest) or 0)


def _flag(value):
    """``--resume_from_checkpoint`` as text: "true" / "false" / "auto" (any case), unless a
    folder of that name exists."""
    if isinstance(value, str) and not os.path.isdir(value):
        lowered = value.lower()
        if lowered in ("true", "false"):
            return lowered == "true" or None
        if lowered == AUTO:
            return AUTO
    return value


def _say(message: str) -> None:
    print(f"hf_zero: {message}", file=sys.stderr, flush=True)
