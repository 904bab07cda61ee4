"""A checkpoint folder's manifest: every file it holds and its size, written last.

The saving rank writes ``hf_zero_manifest.json`` once every rank's files are in the folder and
before the folder is published; a reader checks the folder against it (every file there, at its
size), so a folder that lost a file, or was cut short, is told from a complete one without
trusting its name. The manifest also records which run wrote the folder: a run never replaces a
checkpoint that another run wrote.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

MANIFEST = "hf_zero_manifest.json"


def write_manifest(folder: Path, run_id: str, step: int) -> dict:
    """List every file under ``folder`` (sizes in bytes) into its manifest, flushed to disk."""
    files = {
        str(p.relative_to(folder)): p.stat().st_size
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }
    manifest = {"run_id": run_id, "step": step, "files": files}
    path = folder / MANIFEST
    with open(path, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    return manifest


def read_manifest(folder: Path) -> dict | None:
    """The folder's manifest, or ``None`` when it has none (or an unreadable one)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and "files" in manifest else None


def manifest_problems(folder: Path) -> list[str]:
    """What does not match the manifest (files missing or of another size); ``["no
    manifest"]`` when there is none."""
    manifest = read_manifest(folder)
    if manifest is None:
        return [f"no {MANIFEST}"]
    problems = []
    for name, size in manifest["files"].items():
        path = folder / name
        if not path.is_file():
            problems.append(f"{name} missing")
        elif path.stat().st_size != size:
            problems.append(f"{name} has {path.stat().st_size} bytes, not {size}")
    return problems
