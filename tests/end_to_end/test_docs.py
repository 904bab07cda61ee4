"""Every command block in README.md and docs/RUNNING.md runs as typed, in the environment the
README's quick start sets up (its ``bin`` on ``PATH``, as ``source .venv/bin/activate`` does),
from a folder that has the repository's ``configs/`` and ``recipes/`` (outputs land there, not in
the checkout). ``bash`` blocks run in bash, ``python`` blocks in the environment's Python, and
``yaml`` blocks must be valid hf_zero configs. A block preceded by ``<!-- illustrative: why -->``
is not run (it needs GPUs, several machines, or objects the reader supplies).
"""

import os
import re
import subprocess
import sys

import pytest
import yaml
from helpers import ROOT

from hf_zero import ZeroConfig

DOCS = ["README.md", "docs/RUNNING.md"]


def _blocks() -> list[tuple[str, str, str]]:
    """``(where, language, text)`` of each block to run."""
    found = []
    for doc in DOCS:
        lines = (ROOT / doc).read_text().splitlines()
        i = 0
        while i < len(lines):
            opening = re.fullmatch(r"```(\w*)\s*", lines[i])
            if opening is None:
                i += 1
                continue
            end = lines.index("```", i + 1)
            before = next((x for x in reversed(lines[:i]) if x.strip()), "")
            if opening[1] in ("bash", "python", "yaml") and not before.startswith(
                "<!-- illustrative:"
            ):
                found.append((f"{doc}:{i + 1}", opening[1], "\n".join(lines[i + 1 : end])))
            i = end + 1
    return found


def _cases() -> list[tuple[str, str, str]]:
    """What runs: each shell command once (a command both documents give runs once, named by
    both places), each python and yaml block whole."""
    cases: dict[tuple[str, str], tuple[list[str], str]] = {}
    for where, language, text in _blocks():
        units = [text]
        if language == "bash":  # one command per unit: continuation lines joined, comments out
            joined = re.sub(r"\\\n\s*", " ", text)
            units = [line for line in joined.splitlines() if line.strip() and line[0] != "#"]
        for k, unit in enumerate(units):
            place = f"{where} ({k + 1}/{len(units)})" if len(units) > 1 else where
            cases.setdefault((language, " ".join(unit.split())), ([], unit))[0].append(place)
    return [(" + ".join(places), language, unit) for (language, _), (places, unit) in cases.items()]


BLOCKS = _cases()


def test_the_documents_have_blocks_that_run():
    places = {p.split(":")[0] for where, _, _ in BLOCKS for p in where.split(" + ")}
    assert places == set(DOCS)


@pytest.mark.parametrize("where, language, text", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_documented_block_runs_as_typed(where, language, text, tmp_path):
    if language == "yaml":
        ZeroConfig.load(yaml.safe_load(text))
        return
    for name in ("configs", "recipes"):
        (tmp_path / name).symlink_to(ROOT / name)
    bin_dir = os.path.dirname(sys.executable)
    env = {k: v for k, v in os.environ.items() if k != "HF_ZERO_CONFIG"}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1", VIRTUAL_ENV=os.path.dirname(bin_dir))  # fmt: skip
    command = ["bash", "-euo", "pipefail", "-c", text] if language == "bash" else [
        sys.executable, "-c", text]  # fmt: skip
    done = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"{where}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"


def _documented_names() -> set[str]:
    """Every ``hf_zero.a.b`` and ``from hf_zero.a import b, c`` in the README, docs and
    notebooks, as dotted names (``hf_zero.run`` as a module too: ``python -m hf_zero.run``)."""
    names = set()
    for path in [
        ROOT / "README.md",
        *(ROOT / "docs").glob("*.md"),
        *ROOT.glob("notebooks/*.ipynb"),
    ]:
        text = path.read_text()
        for module, listed in re.findall(r"from (hf_zero[\w.]*) import ([\w, ]+)", text):
            names |= {f"{module}.{n.strip()}" for n in listed.split(",") if n.strip()}
        names |= set(re.findall(r"\bhf_zero(?:\.\w+)+", text))
    return {n.rstrip(".") for n in names}


def test_every_hf_zero_name_in_the_docs_resolves():
    """Names the docs show (functions, classes, modules, constants) exist where they say."""
    import importlib

    missing = []
    for name in sorted(_documented_names()):
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            try:
                for attr in parts[cut:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                missing.append(name)
            break
    assert not missing, missing
    assert "hf_zero.checkpoint.latest_checkpoint" in _documented_names()  # the scan sees names
