"""What every prediction of the doctor starts from: the figures one profile does not measure,
and the facts read off a diagnosis (tokens per rank, bytes per activation value)."""

from __future__ import annotations

from hf_zero.doctor.diagnosis import Diagnosis

ASSUMED = {
    "copy_gbytes_per_s": 10.0,
    "recompute_share": 1 / 3,
    "quantize_gbytes_per_s": 0.15,
    "stage3_compute_share": 0.25,
    "fresh_pages_share": 0.35,
    "dequantize_gbytes_per_s": 1.5,
    "tp_allreduce_gbytes_per_s": {"cpu": 0.1, "other": 100.0},
    "sp_all_to_all_gbytes_per_s": {"cpu": 0.1, "other": 100.0},
    "logits_tile_transients": 4,
}
"""Figures a prediction needs that one profile does not measure: host-device copy bandwidth
(GB/s, PCIe-class), the extra compute of activation checkpointing (one more forward: a third of
forward + backward), what ZeRO++'s quantization and extra host work cost per byte it
quantizes (0.15 GB/s: measured on the 2-node CPU cluster benchmark, where ZeRO++ added about
0.2 s per step besides its link wait; a GPU quantizes far faster), and what gathering and
releasing each unit adds to stage 3's compute (0.25: measured on 2 CPU ranks by
benchmarks/bench_doctor.py, where stage 3 took 1.30x stage 0), and what a fixed mmap threshold
adds to a CPU run's compute (0.35: every large tensor then gets fresh zeroed pages from the OS;
measured on 2 CPU ranks of the doctor's test model, 3.07 -> 4.19 s per step), MixZ++'s
dequantization of the frozen base for each gather (1.5 GB/s of dequantized weights: 142 MB in 94
ms per step in the doctor's test), and AutoTP's activation all-reduces (on CPU 0.1 GB/s of
payload: the doctor's test model took 1.1 s longer per step for 109 MB, waiting and summing on
the 2 cores the ranks share; on GPUs an NVLink-class 100 GB/s, not measured), Ulysses' all-to-alls
(taken at the same rates), and what one tile of tiled logits holds at once in backward, in tiles
of fp32 logits (4: the recomputed logits, their log-probabilities and the gradients of both; 3.3
measured on the doctor's long-sequence model)."""


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def scaled(objects: dict[str, int], **factors: float) -> dict[str, int]:
    return {k: int(v * factors.get(k, 1.0)) for k, v in objects.items()}


def tokens_per_rank(d: Diagnosis) -> float:
    """Tokens one rank's forward saw per step: its data-parallel replica's (a tensor-parallel
    group shares them), of which a sequence-parallel rank holds 1/sp."""
    tp, sp = (max(1, d.config.get(k) or 1) for k in ("tp_size", "sp_size"))
    replicas = max(1, d.world_size // (tp * sp))
    per_step = d.tokens_per_step or d.tokens_per_s * d.step_s
    return per_step / replicas / sp


def dtype_bytes(d: Diagnosis) -> int:
    return 2 if d.config.get("precision") in ("bf16", "fp16") else 4
