"""The error for a full disk while saving: where, how much is free, what a save takes."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterable
from pathlib import Path


class NoSpaceError(OSError):
    """ENOSPC while saving, with the folder, the free space and the size of a previous save."""


class SaveFailedError(OSError):
    """A save that failed on some rank (every rank raises it together)."""


def save_failed_error(
    failed: list[int], code: int, needed: int, folder: Path, failure: Exception | None, rank: int
) -> OSError:
    """The error every rank raises when ``failed`` ranks could not write their part of a save
    into ``folder`` (``code``: the first failure's errno, 0 if none). Rank 0 tells the whole
    story (where, what failed, bytes needed and free); the others point at it, so it is read
    once."""
    if rank != 0:
        what = f"{type(failure).__name__}: {failure}" if failure is not None else "see rank 0"
        return SaveFailedError(code or None, f"hf_zero: saving {folder} failed ({what})")
    cause = os.strerror(code) if code else f"{type(failure).__name__}: {failure}"
    free = shutil.disk_usage(_existing(folder)).free
    kind = NoSpaceError if code == errno.ENOSPC else SaveFailedError
    return kind(
        code or None,
        f"hf_zero: saving {folder} failed on rank(s) {failed} ({cause}); the save needs "
        f"{needed / 2**20:.1f} MiB and {free / 2**20:.1f} MiB are free there. The previous "
        "checkpoints are untouched and the partial save was removed",
    )


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def no_space_error(error: OSError, folder: str | Path, previous: Iterable[Path] = ()) -> OSError:
    """``error`` (an ENOSPC) told as a user can act on it. ``previous``: earlier saves whose
    size says how much one takes."""
    if isinstance(error, NoSpaceError) and isinstance(error.__cause__, OSError):
        error = error.__cause__  # told again for a wider folder (a Trainer's output directory)
    free = shutil.disk_usage(folder).free
    size = max((tree_bytes(Path(p)) for p in previous), default=0)
    took = f"; the last checkpoint took {size / 2**20:.1f} MiB" if size else ""
    return NoSpaceError(
        errno.ENOSPC,
        f"hf_zero: no space left on the device while saving a checkpoint under {folder} "
        f"({free / 2**20:.1f} MiB free{took}); the previous checkpoints are untouched and the "
        f"partial save was not published. Free space or keep fewer checkpoints "
        f"(while writing {error.filename or 'a checkpoint file'}: {error.strerror})",
    )


def tree_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (or of the file), skipping what vanishes meanwhile (a
    folder another process is removing)."""
    total = 0
    with contextlib.suppress(OSError):
        for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
            with contextlib.suppress(OSError):
                total += p.stat().st_size if p.is_file() else 0
    return total
