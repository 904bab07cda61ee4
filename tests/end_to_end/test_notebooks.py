"""The notebooks run top to bottom (their cells assert what they claim) and are stored with
their outputs, which must be current: each cell's text output, run now, equals the stored one
(timings, progress bars and temporary paths aside), and a stored plot is still a plot.
``make notebooks`` re-runs and stores them."""

import os
import re
import sys

import nbformat
import pytest
from helpers import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
from execute_notebooks import execute

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
NOISE = re.compile(r"it/s|s/it|runtime|per_second|\d+%\|")  # timings and progress bars


def _text(output) -> str:
    """What a reader sees of ``output``, minus what differs run to run; stderr (library
    warnings, which name the environment's paths) is left out."""
    if output.output_type == "stream":
        text = output.text if output.name == "stdout" else ""
    else:
        text = output.get("data", {}).get("text/plain", "")
        text = "<image>" if "image/png" in output.get("data", {}) else text
    text = re.sub(r"/tmp/\S+", "<tmp>", text)
    text = re.sub(r"0x[0-9a-f]+", "<address>", text)
    return "\n".join(line for line in text.split("\n") if not NOISE.search(line))


def _outputs(notebook) -> list[list[str]]:
    return [
        [t for o in cell.outputs if o.output_type != "error" and (t := _text(o))]
        for cell in notebook.cells
        if cell.cell_type == "code"
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes_and_its_stored_outputs_are_current(path, tmp_path, monkeypatch):
    for name in ("PATH", "OMP_NUM_THREADS", "MPLBACKEND"):  # `execute` sets them for the kernel
        monkeypatch.setenv(name, os.environ.get(name, ""))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    stored = nbformat.read(path, as_version=4)
    ran = execute(path, str(tmp_path))
    errors = [o for cell in ran.cells if cell.cell_type == "code" for o in cell.outputs
              if o.output_type == "error"]  # fmt: skip
    assert not errors, errors
    assert any(_outputs(stored)), f"{path.name} is stored without outputs: run `make notebooks`"
    assert _outputs(ran) == _outputs(stored), (
        f"{path.name}: stored outputs are stale: run `make notebooks`"
    )
