"""The error for a full disk while saving: where, how much is free, what a save takes."""

from __future__ import annotations

import contextlib
import errno
import shutil
from collections.abc import Iterable
from pathlib import Path


class NoSpaceError(OSError):
    """ENOSPC while saving, with the folder, the free space and the size of a previous save."""


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
