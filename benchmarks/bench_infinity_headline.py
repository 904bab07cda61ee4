"""ZeRO-Infinity's headline: fine-tune a model whose fp32 model states exceed this machine's RAM.

    python benchmarks/bench_infinity_headline.py --hidden 2560 --layers 40 --max_steps 3

Writes a LLaMA-style ``config.json`` (``--hidden``, ``--layers``, vocabulary 32000; 3.21B
parameters at the defaults: 16 bytes each of fp32 model states = 51.4 GB, 2.0x the 23.5 GiB of
RAM here), then runs, exactly as a user would::

    accelerate launch --config_file configs/accelerate/cpu_2proc.yaml recipes/finetune_full.py \\
        --model_config <dir> --zero_config configs/zero/ds_zero3_nvme.json --max_steps 3 ...

The model is built inside `hf_zero.partitioned_init()` (never whole on a rank, its slices going
to the swap files unit by unit); parameters and optimizer state live in swap files under the
JSON's ``nvme_path``; ``save_model`` writes Hugging Face safetensors one unit at a time. While
it runs, this script samples every rank's VmRSS (and reads VmHWM) from ``/proc`` and the swap
directory's size on disk; afterwards it reads the Trainer's log history, and a fresh process
loads the saved model with plain ``from_pretrained`` and compares its logits on the recipe's
probe with those the training run wrote. Prints a table and writes
``--out/bench_infinity_headline.json``. A benchmark, not a test: nothing here is asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def rank_pids(launcher: int) -> list[int]:
    """Python processes under the launcher that run the recipe (the ranks)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "finetune_full.py" in cmd and "accelerate" not in cmd and int(entry.name) != launcher:
            pids.append(int(entry.name))
    return pids


def status(pid: int) -> dict[str, int]:
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def du(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(root, name)).st_blocks * 512
    return total


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=2560)
    p.add_argument("--layers", type=int, default=40)
    p.add_argument("--max_steps", type=int, default=3)
    p.add_argument("--block_size", type=int, default=32)
    p.add_argument("--zero_config", default=str(ROOT / "configs/zero/ds_zero3_nvme.json"))
    p.add_argument("--out", default=str(ROOT / "benchmarks/results"))
    args = p.parse_args(argv)
    from common import llama_shape
    from transformers import LlamaConfig

    out = Path(args.out)
    work = out / "infinity_headline"
    shutil.rmtree(work, ignore_errors=True)
    shape = llama_shape(args.hidden, args.layers, 32000, max(args.block_size, 64))
    config = LlamaConfig(**shape, tie_word_embeddings=True)
    config.save_pretrained(work / "model_config")
    params = (
        shape["vocab_size"] * args.hidden
        + args.layers * (4 * args.hidden**2 + 3 * args.hidden * shape["intermediate_size"])
        + (2 * args.layers + 1) * args.hidden
    )
    nvme = Path(json.loads(Path(args.zero_config).read_text())["zero_optimization"]
                ["offload_param"]["nvme_path"])  # fmt: skip
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(ROOT / "configs/accelerate/cpu_2proc.yaml"),
        str(ROOT / "recipes/finetune_full.py"),
        "--model_config", str(work / "model_config"),
        "--zero_config", args.zero_config,
        "--output_dir", str(work / "output"),
        "--max_steps", str(args.max_steps),
        "--block_size", str(args.block_size),
        "--per_device_train_batch_size", "1",
        "--logging_steps", "1",
        "--save_strategy", "no",
        "--report_to", "none",
        "--learning_rate", "1e-4",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    start = time.time()
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    samples: list[dict] = []
    trained_at: list[float] = []  # when the Trainer reported train_runtime (then it saves)

    def reader() -> None:
        for line in proc.stdout:
            if "train_runtime" in line and not trained_at:
                trained_at.append(time.time() - start)
            print(line, end="", flush=True)

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    peak: dict[int, int] = {}
    while proc.poll() is None:
        pids = rank_pids(proc.pid)
        rss = {pid: status(pid) for pid in pids}
        for pid, s in rss.items():
            peak[pid] = max(peak.get(pid, 0), s.get("VmHWM", 0), s.get("VmRSS", 0))
        samples.append({
            "t": time.time() - start,
            "rss": {str(pid): s.get("VmRSS", 0) for pid, s in rss.items()},
            "disk": du(nvme) if nvme.exists() else 0,
        })  # fmt: skip
        time.sleep(1.0)
    thread.join()
    history_file = work / "output" / "log_history.json"
    history = json.loads(history_file.read_text()) if history_file.exists() else []
    end_of_training = trained_at[0] if trained_at else float("inf")
    training = [s for s in samples if s["t"] <= end_of_training]
    train_peak = {}
    for sample in training:
        for pid, rss in sample["rss"].items():
            train_peak[pid] = max(train_peak.get(pid, 0), rss)
    result = {
        "params": params,
        "model_states_fp32_gb": 16 * params / 1e9,
        "ram_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30,
        "returncode": proc.returncode,
        "wall_s": time.time() - start,
        "peak_rss_per_rank_gb": [v / 1e9 for v in peak.values()],  # VmHWM, with the save
        "training_rss_per_rank_gb": [v / 1e9 for v in train_peak.values()],  # sampled, 1 s
        "training_s": end_of_training,
        "peak_disk_gb": max((s["disk"] for s in samples), default=0) / 1e9,
        "log_history": history,
        "samples": samples,
        "command": " ".join(cmd),
    }
    saved = work / "output"
    result["saved_gb"] = sum(f.stat().st_size for f in saved.glob("*.safetensors")) / 1e9
    result["saved_files"] = sorted(f.name for f in saved.glob("model*.safetensors*"))
    if proc.returncode == 0:
        result["reload"] = reload_and_compare(saved)
    (out / "bench_infinity_headline.json").write_text(json.dumps(result, indent=1))
    losses = [h["loss"] for h in history if "loss" in h]
    print(f"\nmodel: {params / 1e9:.2f}B parameters, fp32 model states "
          f"{result['model_states_fp32_gb']:.1f} GB, RAM {result['ram_gib']:.1f} GiB")  # fmt: skip
    print(f"exit {proc.returncode}; wall {result['wall_s']:.0f} s; losses {losses}")
    steps = [h for h in history if "loss" in h]
    print(f"training RSS per rank, sampled (GB): "
          f"{[round(v, 2) for v in result['training_rss_per_rank_gb']]}; VmHWM with the final "
          f"save_model: {[round(v, 2) for v in result['peak_rss_per_rank_gb']]}; peak swap on "
          f"disk {result['peak_disk_gb']:.1f} GB; {len(steps)} logged steps")  # fmt: skip
    print(f"saved {result['saved_gb']:.1f} GB as {len(result['saved_files'])} files; "
          f"reloaded in a fresh process: {result.get('reload')}")  # fmt: skip
    return proc.returncode


RELOAD = """
import json, resource, sys, time, torch
sys.path.insert(0, {recipes!r})
from recipe_utils import probe_logits
from transformers import AutoModelForCausalLM
from hf_zero.tiny import tiny_tokenizer
start = time.time()
model = AutoModelForCausalLM.from_pretrained({saved!r})
loaded = time.time() - start
logits = probe_logits(model, tiny_tokenizer(), "cpu").float()
trained = torch.load({saved!r} + "/probe_logits.pt").float()
print(json.dumps({{
    "max_abs_diff": (logits - trained).abs().max().item(),
    "equal": torch.equal(logits, trained),
    "load_s": loaded,
    "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9,
}}))
"""


def reload_and_compare(saved: Path) -> dict:
    """A fresh process: plain ``from_pretrained`` of what the run saved, then the recipe's
    probe logits against those the training run wrote after training."""
    code = RELOAD.format(recipes=str(ROOT / "recipes"), saved=str(saved))
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ)
    )
    if done.returncode:
        return {"error": done.stderr[-2000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    sys.exit(main())
