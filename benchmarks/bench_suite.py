"""Where the test suite's CPU time goes: every Python process it starts, by kind, against the
machine's busy time.

    python benchmarks/bench_suite.py [--out DIR] -- -n 2 --dist loadfile --no-loadscope-reorder

Runs pytest (the arguments after ``--``; ``OMP_NUM_THREADS=1`` as ``make test`` sets it) with a
``sitecustomize`` on ``PYTHONPATH`` that records, when each Python process exits, its command
line, CPU time (user + system, ``getrusage``), which heavy libraries it imported, and the test
that was running (``PYTEST_CURRENT_TEST``, which launched processes inherit). The machine's
busy and idle time come from ``/proc/stat`` before and after. Processes that end without running
``atexit`` (ranks forked by `hf_zero.testing.run_distributed`, which leave by ``os._exit``;
processes killed by a signal) are not recorded one by one: they are in "not recorded", the busy
time less what was recorded. The import cost of one process of each kind is measured apart (the
fastest of three cold imports), so the table also shows how much of a kind's time is imports.

Prints two tables (by kind; the test files whose processes used the most) and writes
``suite.json``. A measurement of the suite, not a pass/fail check.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

RECORDER = """
import atexit, json, os, resource, sys, time
_start = time.time()
def _record():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    heavy = ("transformers.trainer", "peft", "bitsandbytes", "hf_zero", "accelerate", "trl")
    row = {"argv": getattr(sys, "orig_argv", sys.argv), "start": _start, "end": time.time(),
           "cpu": usage.ru_utime + usage.ru_stime, "sys": usage.ru_stime,
           "modules": [m for m in heavy if m in sys.modules],
           "test": os.environ.get("PYTEST_CURRENT_TEST", "")}
    path = os.path.join(os.environ["HF_ZERO_SUITE_LOG"], f"{os.getpid()}-{_start:.6f}.json")
    with open(path, "w") as f:
        json.dump(row, f)
atexit.register(_record)
"""

IMPORTS = {  # kind -> what a process of that kind imports before its own work
    "launcher": "import accelerate.commands.launch",
    "Trainer rank": "from transformers import Trainer",  # a lower bound: hf_zero.run adds its own
    "hf_zero process": "import hf_zero; from hf_zero.tiny import tiny_llama; tiny_llama(0)",
}


def kind(row: dict) -> str:
    """What the process was: a launcher, a rank that imported transformers' Trainer, another
    process that imported hf_zero, pytest itself, or anything else."""
    command = " ".join(row["argv"])
    if "accelerate.commands.launch" in command or "torch.distributed.run" in command:
        return "launcher"
    head = " ".join(row["argv"][:4])  # the interpreter and what it runs, not the arguments
    if re.search(r"-m pytest\b|/pytest\b|xdist|execnet", head):
        return "pytest"
    if "transformers.trainer" in row["modules"]:
        return "Trainer rank"
    if "hf_zero" in row["modules"]:
        return "hf_zero process"
    return "other"


def cpu_ticks() -> tuple[float, float, float]:
    """Seconds of (user + nice, system + interrupts, idle + iowait) summed over all CPUs."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    user, nice, system, idle, iowait, irq, softirq = fields[:7]
    return (user + nice) / hz, (system + irq + softirq) / hz, (idle + iowait) / hz


def import_seconds(statement: str, repeats: int = 3) -> float:
    """CPU seconds of a fresh interpreter that runs ``statement`` (the fastest of ``repeats``)."""
    code = f"import resource; {statement}; u = resource.getrusage(resource.RUSAGE_SELF); "
    code += "print(u.ru_utime + u.ru_stime)"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=env, check=True) for _ in range(repeats)]  # fmt: skip
    return min(float(r.stdout.split()[-1]) for r in runs)


def summarize(rows: list[dict], busy: float, wall: float, idle: float, imports: dict) -> dict:
    """The tables' numbers: per kind and per test file (processes, CPU seconds)."""
    kinds: dict = collections.defaultdict(lambda: {"processes": 0, "cpu_s": 0.0, "sys_s": 0.0})
    files: dict = collections.defaultdict(lambda: {"processes": 0, "cpu_s": 0.0})
    for row in rows:
        name = kind(row)
        k = kinds[name]
        k["processes"] += 1
        k["cpu_s"] += row["cpu"]
        k["sys_s"] += row["sys"]
        if row["test"] and name != "pytest":
            f = files[row["test"].split("::")[0]]
            f["processes"] += 1
            f["cpu_s"] += row["cpu"]
    for name, k in kinds.items():
        k["imports_s"] = k["processes"] * imports[name] if name in imports else None
    recorded = sum(k["cpu_s"] for k in kinds.values())
    kinds["not recorded"] = {"processes": None, "cpu_s": busy - recorded, "sys_s": None}
    return {"wall_s": wall, "busy_s": busy, "idle_s": idle, "import_s_each": imports,
            "kinds": dict(kinds), "files": dict(files)}  # fmt: skip


def print_tables(result: dict) -> None:
    busy = result["busy_s"]
    print(f"wall {result['wall_s']:.0f} s; CPUs busy {busy:.0f} s, idle {result['idle_s']:.0f} s")
    print("| kind | processes | CPU s | of busy | system s | imports s (est.) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, k in sorted(result["kinds"].items(), key=lambda kv: -kv[1]["cpu_s"]):
        count = "" if k["processes"] is None else k["processes"]
        system = "" if k["sys_s"] is None else f"{k['sys_s']:.0f}"
        imports = "" if k.get("imports_s") is None else f"{k['imports_s']:.0f}"
        share = k["cpu_s"] / busy if busy else 0.0
        print(f"| {name} | {count} | {k['cpu_s']:.0f} | {share:.0%} | {system} | {imports} |")
    print("\n| test file | processes | CPU s |")
    print("|---|---:|---:|")
    for name, f in sorted(result["files"].items(), key=lambda kv: -kv[1]["cpu_s"])[:15]:
        print(f"| {name} | {f['processes']} | {f['cpu_s']:.0f} |")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    ours, pytest_args = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args(ours)
    imports = {name: import_seconds(statement) for name, statement in IMPORTS.items()}
    with tempfile.TemporaryDirectory() as hook, tempfile.TemporaryDirectory() as log:
        Path(hook, "sitecustomize.py").write_text(RECORDER)
        path = os.pathsep.join(p for p in (hook, os.environ.get("PYTHONPATH", "")) if p)
        env = dict(os.environ, PYTHONPATH=path, HF_ZERO_SUITE_LOG=log, OMP_NUM_THREADS="1")
        before, started = cpu_ticks(), time.time()
        done = subprocess.run([sys.executable, "-m", "pytest", *pytest_args], cwd=ROOT, env=env)
        wall, after = time.time() - started, cpu_ticks()
        rows = [json.loads(p.read_text()) for p in Path(log).glob("*.json")]
    busy = (after[0] - before[0]) + (after[1] - before[1])
    result = summarize(rows, busy, wall, after[2] - before[2], imports)
    result["pytest_status"] = done.returncode
    print_tables(result)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "suite.json").write_text(json.dumps(result, indent=1))
    return done.returncode


if __name__ == "__main__":
    raise SystemExit(main())
