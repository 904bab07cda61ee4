"""How fast this machine's CPU computes in 16 bits: one linear layer's three matrix products, and
a forward + backward of the cluster benchmark's tiny Qwen2, per dtype, one thread.

    python benchmarks/bench_matmul_dtypes.py

Without bf16/fp16 instructions (AVX2-only CPUs) torch falls back to slow kernels for some
layouts, and a 16-bit training step is compute-bound however fast the link is: read this before
comparing 16-bit runs of ``benchmarks/cluster/bench_cluster.py`` across machines. Writes
``benchmarks/results/matmul_dtypes.json``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _ms(fn, repeats: int = 5) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def _model_ms(dtype: torch.dtype) -> float:
    """Forward + backward of the cluster benchmark's model (batch 1 x 32), median of 3."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(dtype)
    x = torch.randint(0, 8192, (1, 32))

    def step() -> None:
        model(input_ids=x, labels=x).loss.backward()

    return sorted(_ms(step, 1) for _ in range(3))[1]


def _linear_ms(dtype: torch.dtype, m: int, k: int, n: int) -> dict[str, float]:
    """A linear layer's forward product and its backward's two, ``m`` tokens, ``k -> n``."""
    x, w = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
    g = torch.randn(m, n, dtype=dtype)
    return {
        "forward x @ W.T (ms)": _ms(lambda: x @ w.t()),
        "input grad g @ W (ms)": _ms(lambda: g @ w),
        "weight grad g.T @ x (ms)": _ms(lambda: g.t() @ x),
    }


def main() -> None:
    torch.set_num_threads(1)
    # 32 tokens x hidden 512 -> intermediate 1408, as in the cluster model's MLP
    rows = {
        name: {
            **_linear_ms(dtype, 32, 512, 1408),
            "model forward + backward (ms)": _model_ms(dtype),
        }
        for name, dtype in DTYPES.items()
    }
    columns = list(rows["fp32"])
    print(f"torch {torch.__version__}, 1 thread; ratios against fp32")
    print("| dtype | " + " | ".join(columns) + " |")
    print("|---|" + "---:|" * len(columns))
    for name, row in rows.items():
        cells = [f"{row[c]:.2f} ({row[c] / rows['fp32'][c]:.1f}x)" for c in columns]
        print(f"| {name} | " + " | ".join(cells) + " |")
    out = ROOT / "benchmarks" / "results" / "matmul_dtypes.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
