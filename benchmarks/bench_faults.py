"""How long a fault takes to become an error: the time from the fault to the job's exit.

    python benchmarks/bench_faults.py [--repeats 2]

Each row launches the LoRA recipe on 2 CPU ranks (``accelerate launch``) with one fault from
``tests/scripts/faulty_recipe.py``, which prints the moment the fault starts; the time to
detection is the launcher's exit minus that moment. The fingerprint row times ``initialize``
on ranks that built different models (one more layer on rank 1), in process. Prints a table and
writes ``benchmarks/results/faults.json``. docs/RUNNING.md's "What survives what" quotes it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def _launch(fault: str, *flags: str) -> float:
    """Seconds from the fault's start to the launcher's exit (which must be a failure)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "recipes"))
    env.update(HF_ZERO_TEST_FAULT=fault, HF_ZERO_TEST_RECIPE="finetune_lora")
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file"]
        cmd += [str(ROOT / "configs/accelerate/cpu_2proc.yaml")]
        cmd += [str(ROOT / "tests/scripts/faulty_recipe.py"), "--max_steps", "6"]
        cmd += ["--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true"]
        cmd += ["--output_dir", out, *flags]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        ended = time.time()
    started = re.search(r"hf_zero test fault: \w+ at ([0-9.]+)", done.stderr)
    if done.returncode == 0 or started is None:
        raise RuntimeError(f"{fault}: rc {done.returncode}\n{done.stderr[-3000:]}")
    return ended - float(started.group(1))


def _built_differently() -> float:
    """One rank: initialize a model with one more layer on rank 1; seconds until it refuses."""
    import torch
    import torch.distributed as dist
    from helpers import MODEL

    import hf_zero
    from hf_zero.tiny import tiny_llama

    extra = {"num_hidden_layers": MODEL["num_hidden_layers"] + 1} if dist.get_rank() else {}
    model = tiny_llama(0, **{**MODEL, **extra})
    start = time.perf_counter()
    try:
        hf_zero.initialize(model, torch.optim.AdamW(model.parameters()), stage=3)
    except ValueError:
        return time.perf_counter() - start
    raise RuntimeError("initialize accepted different models")


def _fingerprint() -> float:
    """Seconds ``initialize`` takes to refuse ranks that built different models (slowest rank)."""
    from hf_zero.testing import run_distributed

    return max(run_distributed(_built_differently, 2, timeout=120))


ROWS = {
    "a rank is SIGKILLed mid-training": lambda: _launch("die@0"),
    "a rank stalls; --ddp_timeout 5": lambda: _launch("stall@120", "--ddp_timeout", "5"),
    "ranks built different models (initialize)": _fingerprint,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    results = {}
    for name, measure in ROWS.items():
        times = [measure() for _ in range(args.repeats)]
        results[name] = {"seconds": times, "median": statistics.median(times)}
    print(f"| fault | time to an error (median of {args.repeats}) | runs |")
    print("|---|---:|---|")
    for name, r in results.items():
        runs = ", ".join(f"{t:.2f}" for t in r["seconds"])
        print(f"| {name} | {r['median']:.2f} s | {runs} |")
    out = ROOT / "benchmarks" / "results" / "faults.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
