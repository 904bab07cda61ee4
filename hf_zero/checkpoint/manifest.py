"""A checkpoint folder's manifest: every file it holds, its size and CRC-32, written last.

The saving rank writes ``hf_zero_manifest.json`` once every rank's files are in the folder and
before the folder is published. A reader checks the folder against it: every file there at its
size (cheap: how the latest complete checkpoint is found), and, for the checkpoint a run resumes
from, every file's CRC-32, so a folder that lost a file, was cut short or had bytes changed is
told from a complete one without trusting its name. The engine's shard files (``zero/``) are
listed by size only: they carry a CRC-32 per block, verified on every read. The manifest also
records which run wrote the folder: a run never replaces a checkpoint that another run wrote.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

MANIFEST = "hf_zero_manifest.json"
SELF_CHECKED = ("zero/",)
"""Folders whose files carry checksums of their own (the engine's shards): sizes only here."""
_CHUNK = 1 << 22


def write_manifest(folder: Path, run_id: str, step: int) -> dict:
    """List every file under ``folder`` (sizes in bytes) into its manifest, flushed to disk."""
    files = {}
    for path in sorted(folder.rglob("*")):
        name = str(path.relative_to(folder))
        if path.is_file() and name != MANIFEST:
            entry = {"size": path.stat().st_size}
            if not name.startswith(SELF_CHECKED):
                entry["crc32"] = file_crc32(path)
            files[name] = entry
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


def manifest_problems(folder: Path, checksums: bool = False) -> list[str]:
    """What does not match the manifest: files missing or of another size and, with
    ``checksums``, of other contents; ``["no manifest"]`` when there is none."""
    manifest = read_manifest(folder)
    if manifest is None:
        return [f"no {MANIFEST}"]
    problems = []
    for name, entry in manifest["files"].items():
        entry = entry if isinstance(entry, dict) else {"size": entry}  # size-only manifests
        path = folder / name
        if not path.is_file():
            problems.append(f"{name} missing")
        elif path.stat().st_size != entry["size"]:
            problems.append(f"{name} has {path.stat().st_size} bytes, not {entry['size']}")
        elif checksums and "crc32" in entry and file_crc32(path) != entry["crc32"]:
            problems.append(f"{name}: checksum mismatch (its bytes changed after the save)")
    return problems


def file_crc32(path: Path) -> int:
    """CRC-32 of a whole file, read in 4 MiB pieces."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc
