"""What a restart and a pre-emption cost: times measured from outside the run.

    python benchmarks/bench_restarts.py [--repeats 3]

Each row launches the unmodified ``recipes/examples/run_clm.py`` under ``-m hf_zero.run`` on 2
CPU ranks (stage 3) and injects the fault from outside, as tests/end_to_end/test_restarts.py does:

* SIGTERM to ``accelerate launch`` after step 3, with ``--zero_save_on_sigterm true``: seconds
  to the launcher's exit, and to the "saved checkpoint-N" line (the save itself);
* the same without the setting (nothing is saved);
* rank 1 SIGKILLed once ``checkpoint-4`` exists, under ``torchrun --max-restarts 2``: seconds
  from the kill to the restarted round's "resuming from" line, and the whole run's extra time
  over an uninterrupted one.

Prints a table (median, min, max) and writes ``benchmarks/results/restarts.json``.
docs/RUNNING.md's "What survives what" quotes it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from helpers import ACCELERATE, TORCHRUN  # noqa: E402  (the tests' launch commands)
from helpers import clm_command as _command  # noqa: E402


def _start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip


def sigterm(save: bool) -> dict[str, float]:
    """Seconds from SIGTERM (after step 3) to the launcher's exit, and to the saved line."""
    with tempfile.TemporaryDirectory() as out:
        flags = ["--save_steps", "100"] + (["--zero_save_on_sigterm", "true"] if save else [])
        run = _start(_command(ACCELERATE, out, 40, *flags))
        steps, sent, saved = 0, None, None
        for line in run.stdout:
            if sent is None and line.startswith("{'loss'"):
                steps += 1
                if steps == 3:
                    sent = time.monotonic()
                    run.send_signal(signal.SIGTERM)
            elif sent is not None and "hf_zero: saved checkpoint-" in line:
                saved = time.monotonic() - sent
        run.wait()
        row = {"exit_s": time.monotonic() - sent, "launcher_status": run.returncode}
        if save:
            if saved is None:
                raise RuntimeError("no checkpoint was saved after SIGTERM")
            row["saved_s"] = saved
        return row


def elastic_restart() -> dict[str, float]:
    """Rank 1 killed once checkpoint-4 exists: seconds to the restarted round's resume line,
    and the run's wall time."""
    with tempfile.TemporaryDirectory() as out:
        began = time.monotonic()
        run = _start(_command(TORCHRUN, out, 10, "--save_steps", "2"))
        killed_at = []

        def kill() -> None:
            while run.poll() is None and not killed_at:
                if (Path(out) / "checkpoint-4").exists():
                    for child in psutil.Process(run.pid).children(recursive=True):
                        if child.environ().get("RANK") == "1" and "hf_zero.run" in child.cmdline():
                            child.kill()
                            killed_at.append(time.monotonic())
                            return
                time.sleep(0.005)

        threading.Thread(target=kill, daemon=True).start()
        resumed = None
        for line in run.stdout:
            if killed_at and resumed is None and "hf_zero: restart round 1" in line:
                resumed = time.monotonic() - killed_at[0]
        if run.wait() != 0 or resumed is None:
            raise RuntimeError(f"elastic run: status {run.returncode}, resumed {resumed}")
        return {"resume_s": resumed, "run_s": time.monotonic() - began}


def uninterrupted() -> float:
    with tempfile.TemporaryDirectory() as out:
        began = time.monotonic()
        done = subprocess.run(
            _command(TORCHRUN, out, 10, "--save_steps", "2"), cwd=ROOT, capture_output=True,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(done.stderr[-3000:])
        return time.monotonic() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        rows.setdefault(name, []).append(round(value, 2))

    for _ in range(args.repeats):  # interleaved: each round measures every row once
        on = sigterm(save=True)
        add("SIGTERM, save_on_sigterm: SIGTERM -> checkpoint published", on["saved_s"])
        add("SIGTERM, save_on_sigterm: SIGTERM -> launcher exit", on["exit_s"])
        add("SIGTERM, default: SIGTERM -> launcher exit", sigterm(save=False)["exit_s"])
        restart = elastic_restart()
        add("elastic restart: kill -> restarted round resumes", restart["resume_s"])
        add("elastic restart: whole run (10 steps)", restart["run_s"])
        add("uninterrupted: whole run (10 steps)", uninterrupted())
    print("| event | median (s) | min | max | runs |\n|---|---:|---:|---:|---|")
    for name, values in rows.items():
        print(
            f"| {name} | {statistics.median(values):.2f} | {min(values):.2f} | "
            f"{max(values):.2f} | {', '.join(f'{v:.2f}' for v in values)} |"
        )
    results = ROOT / "benchmarks" / "results"
    results.mkdir(exist_ok=True)
    (results / "restarts.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
