"""Is a folder one this process can write into? Asked at start, not at the first save.

The answer comes from trying: a probe file is written and removed in the folder or, while it
does not exist yet, in the nearest folder above it (where the first save would create it), so
permissions, read-only mounts, a full quota's refusal and a file where a folder should be are
all found, whoever the user is (root passes every permission check ``os.access`` makes), and
nothing is left behind.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def unwritable_dir(path: str | os.PathLike, key: str) -> str | None:
    """``None`` when ``path`` is (or could be made) a folder this process writes into; else a
    one-line message naming ``key`` (the flag or config key), the path and why."""
    path = Path(path)
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        what = "is a file" if existing == path else f"lies under the file {existing}"
        return f"{key} {str(path)!r} {what}: it must be a directory that this process can write"
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".hf_zero-probe-"):
            pass
    except OSError as error:
        return (
            f"{key} {str(path)!r} is not writable ({error.strerror or error}): give a "
            "directory this process can create files in"
        )
    return None
