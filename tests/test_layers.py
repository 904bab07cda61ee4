"""The package's imports follow the layer list in docs/ARCHITECTURE.md: no module imports from a
layer after its own, and no two modules import each other (through any chain), counting imports
inside functions. Imports under ``if TYPE_CHECKING:`` never run, so they make no circle; they
still may not reach a later layer."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hf_zero"


def documented_layers() -> list[str]:
    """The layers, first to last, from the fenced block after ARCHITECTURE.md's marker line."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    block = re.search(r"<!-- layers -->\s*```text\n(.*?)```", text, re.S)
    assert block, "docs/ARCHITECTURE.md has no '<!-- layers -->' block"
    return [line.split()[0] for line in block.group(1).splitlines() if line.strip()]


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    out = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def imports(known: dict[str, Path]) -> dict[str, dict[str, bool]]:
    """module -> {imported hf_zero module: whether the import runs (not TYPE_CHECKING only)}."""

    def resolve(name: str) -> str:
        while name not in known:
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, dict[str, bool]] = {}
    for name, path in known.items():
        tree = ast.parse(path.read_text())
        type_only = _type_checking_nodes(tree)
        deps: dict[str, bool] = {}
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        pkg = pkg.rpartition(".")[0]
                    base = f"{pkg}.{base}" if base else pkg
                targets = [f"{base}.{a.name}" for a in node.names]
            for target in targets:
                if target.split(".")[0] != "hf_zero":
                    continue
                dep = resolve(target)
                if dep != name:
                    deps[dep] = deps.get(dep, False) or id(node) not in type_only
        graph[name] = deps
    return graph


def layer_of(module: str, layers: list[str]) -> int:
    """``hf_zero.<folder>...`` is that folder's layer; anything else is the top (last) one."""
    parts = module.split(".")
    folder = parts[1] if len(parts) > 1 else ""
    return layers.index(folder) if folder in layers else len(layers) - 1


def test_the_documented_layers_name_every_folder_of_the_package():
    layers = documented_layers()
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert folders <= set(layers), sorted(folders - set(layers))
    assert layers[-1] == "top", layers  # the entry points: hf_zero/*.py


def upward_imports(graph: dict[str, dict[str, bool]], layers: list[str]) -> list[str]:
    return [
        f"{m} ({layers[layer_of(m, layers)]}) imports {d} ({layers[layer_of(d, layers)]})"
        for m, deps in sorted(graph.items())
        for d in deps
        if layer_of(d, layers) > layer_of(m, layers)
    ]


def circles(graph: dict[str, dict[str, bool]]) -> list[str]:
    """Every chain of run-time imports that leads from a module back to itself."""
    runtime = {m: {d for d, runs in deps.items() if runs} for m, deps in graph.items()}
    found = []
    for start in sorted(runtime):
        stack, seen = [(start, [start])], set()
        while stack:
            module, path = stack.pop()
            for dep in sorted(runtime.get(module, ())):
                if dep == start:
                    found.append(" -> ".join([*path, start]))
                elif dep not in seen:
                    seen.add(dep)
                    stack.append((dep, [*path, dep]))
    return sorted(set(found))


def test_no_module_imports_from_a_later_layer():
    upward = upward_imports(imports(modules()), documented_layers())
    assert not upward, "\n".join(upward)


def test_no_import_circles():
    found = circles(imports(modules()))
    assert not found, "\n".join(found)


def test_the_checks_find_an_upward_import_and_a_circle(tmp_path):
    """The checks above can fail: a package whose config imports its engine (a later layer)
    inside a function, and whose engine imports its config."""
    package = tmp_path / "hf_zero"
    sources = {
        "config": "def f():\n    from hf_zero.engine import run\n",
        "engine": "from hf_zero.config import f\n",
        "optim": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from hf_zero import engine\n",
    }
    for folder, text in sources.items():
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text(text)
    (package / "__init__.py").write_text("")
    graph = imports(modules(package))
    assert graph["hf_zero.optim"] == {"hf_zero.engine": False}  # type-only: no circle
    layers = ["config", "optim", "engine", "top"]
    assert upward_imports(graph, layers) == [
        "hf_zero.config (config) imports hf_zero.engine (engine)",
        "hf_zero.optim (optim) imports hf_zero.engine (engine)",
    ]
    assert circles(graph) == [
        "hf_zero.config -> hf_zero.engine -> hf_zero.config",
        "hf_zero.engine -> hf_zero.config -> hf_zero.engine",
    ]


SAVE_CODE = ["checkpointing", "full_state_dict", "pretrained_save", "save_failure"]
"""The engine's save, load and export modules: they see an engine as `EngineState`."""


def engine_reads(source: str) -> set[str]:
    """Every ``engine.<name>`` the source reads or writes."""
    return {
        node.attr
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "engine"
    }


def declared(protocol: str) -> set[str]:
    """The names a Protocol class in hf_zero/engine/state_view.py declares."""
    tree = ast.parse((PACKAGE / "engine" / "state_view.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == protocol]
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)}


def test_save_code_reads_only_what_engine_state_declares_and_never_imports_the_engine():
    graph = imports(modules())
    allowed = declared("EngineState")
    for name in SAVE_CODE:
        module = f"hf_zero.engine.{name}"
        assert "hf_zero.engine.zero_engine" not in graph[module], module
        extra = engine_reads((PACKAGE / "engine" / f"{name}.py").read_text()) - allowed
        assert not extra, f"{module} reads engine.{sorted(extra)}: declare it in EngineState"
    importers = [m for m, deps in graph.items() if "hf_zero.engine.zero_engine" in deps]
    beside = [m for m in importers if m.startswith("hf_zero.engine.")]  # the package re-exports
    assert beside == [], beside
    assert engine_reads("engine.groups[0]; x = engine.topology.rank") == {"groups", "topology"}
