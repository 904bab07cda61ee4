"""What the benchmark scripts share."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path


def llama_shape(hidden: int, layers: int, vocab: int, seq_len: int) -> dict:
    """LLaMA-style dimensions from a width and a depth: MLP 8/3 of the hidden size (a multiple
    of 64), 64-wide attention heads, no grouped-query sharing."""
    return dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=seq_len,
    )


def launch_ranks(
    script: str, nproc: int, flags: list[str], results: Path, label: str, timeout: float
) -> list[dict]:
    """Run ``python script *flags --result <file>`` as ``nproc`` fresh ranks (gloo env vars,
    one thread each) and return each rank's JSON result, by rank; ``results`` is the stem of
    the per-rank result files."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs, files = [], []
    for rank in range(nproc):
        out = results.with_name(f"{results.name}.{rank}.json")
        files.append(out)
        env = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(nproc),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(nproc),
            OMP_NUM_THREADS="1",
        )
        cmd = [sys.executable, script, *flags, "--result", str(out)]
        procs.append(subprocess.Popen(cmd, env=env))
    codes = [p.wait(timeout=timeout) for p in procs]
    if any(codes):
        raise RuntimeError(f"{label}: ranks exited with {codes}")
    return [json.loads(f.read_text()) for f in files]
