"""Resident memory measured from outside the engine: the process's RSS against `hf-zero estimate`.

`benchmarks/bench_memory.py` starts a fresh 2-rank gloo group per configuration (one process per
rank, ``OMP_NUM_THREADS=1``), builds a LLaMA-style model from config (stage 3 inside
`hf_zero.partitioned_init()`), calls `initialize()` and trains 2 steps, reading ``VmRSS`` /
``VmHWM`` from ``/proc/self/status``. Here at 110M parameters (hidden 768, 12 layers, vocabulary
32000), the issue's "at least 100M", with 4 tokens per step (activations are not what this
measures, and bf16 matmuls are slow on CPUs without bf16 instructions): five configurations take
about 100 s on the 2-core CI machine (docs/BENCHMARKS.md has the table for every configuration,
from the same script).

Asserted: the RSS growth from before the model is built, at the model-state peak (after the
second step's backward, before its optimizer step) and between steps (after it), is within 15% of
`hf_zero.memory.estimate` (device + host bytes: both are this process's memory on CPU), read
after ``malloc_trim(0)``; and `memory_report()` equals the estimate up to padding.

What else the RSS holds, measured (41M / 110M parameters):

* the libraries' first-use buffers (autograd's engine, the matmul kernels' scratch for the dtype,
  gloo's pairs): 25-60 MB depending on the CPU (the larger on one with ``avx512_bf16``), which
  would be 15-20% of stage 3 16-bit's 329 MB between steps. The benchmark runs them once on a
  tiny plain-torch model before its ``base`` reading, so they are not counted.
* what does not scale with the model and is left: 2-14 MB at stages 1-2, 24-36 MB at stage 3
  (0-8% at 110M, docs/BENCHMARKS.md).
* freed memory glibc keeps (the raw column): backward's per-unit gradient buffers and gathered
  weights fall under glibc's self-raising mmap threshold, come from the heap and stay mapped
  when freed. The engine now gives them back after each optimizer step on CPU
  (`hf_zero.storage.host_memory`), so between steps raw equals trimmed; at the peak (before the step)
  raw reads 1.13x (stage 2) and 1.45-1.58x (stage 3) at 41M bf16.
* transients, not resident: activations (10 MB at 32 tokens), stage 3's gathered units, the
  step's one-bucket fp32 gradient copy and AdamW's temporaries, the reduction buffers of
  backward. They show in ``VmHWM`` (reported by the benchmark, not asserted): backward's
  full-size gradient buffers of stages 2-3 live until their reduction is done, at most two
  buckets' worth in flight.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT

CONFIGS = [
    "stage 1 bf16",
    "stage 2 bf16",
    "stage 3 bf16",
    "stage 3 bf16 offload",
    "stage 3 bf16 16-bit",
]


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_rss_growth_matches_the_estimate(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_memory.py"), "--out", str(tmp_path)]
    cmd += ["--hidden", "768", "--layers", "12", "--seq_len", "4", "--only", *CONFIGS]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "bench_memory.json").read_text())
    assert result["params"] >= 100e6  # the size: fixed overheads are ~2-3% here
    assert set(result["summary"]) == set(CONFIGS)
    for name, rows in result["summary"].items():
        for point in ("peak", "between"):
            row = rows[point]
            assert abs(row["report_vs_estimate"] - 1) < 0.01, (name, point, row)
            # The 15% at >= 100M parameters (docs/BENCHMARKS.md: 1.002-1.075).
            assert 0.85 <= row["ratio_trimmed"] <= 1.15, (name, point, row)
        # Stages 2-3 free the gradient shard at the step, and the process gives it back.
        if not name.startswith("stage 1"):
            assert rows["between"]["estimate"] < rows["peak"]["estimate"]
            assert rows["between"]["rss_growth_trimmed"] < rows["peak"]["rss_growth_trimmed"]
