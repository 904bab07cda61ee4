"""Run every notebook top to bottom and store it with its outputs (``make notebooks``).

    python scripts/execute_notebooks.py [notebooks/x.ipynb ...]

One process, CPU, ``OMP_NUM_THREADS=1``, matplotlib's Agg backend: the settings
tests/end_to_end/test_notebooks.py runs them with, so the stored outputs are what CI compares
against.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]


def execute(path: Path, workdir: str) -> nbformat.NotebookNode:
    """``path`` executed in ``workdir`` (this interpreter as the kernel)."""
    os.environ.update(OMP_NUM_THREADS="1", MPLBACKEND="Agg")
    os.environ.pop("WORLD_SIZE", None)  # a notebook is one process
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": workdir}}
    ).execute()
    for cell in notebook.cells:  # timings are noise in a stored file
        cell.get("metadata", {}).pop("execution", None)
    return notebook


def main(paths: list[str]) -> None:
    for path in [Path(p) for p in paths] or sorted((ROOT / "notebooks").glob("*.ipynb")):
        with tempfile.TemporaryDirectory() as workdir:
            nbformat.write(execute(path, workdir), path)
        print(f"executed and stored {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
