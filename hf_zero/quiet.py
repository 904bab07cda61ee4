"""Third-party notices that say nothing about the user's run, dropped before they print.

On a CPU with AVX512-BF16, bitsandbytes logs a warning at import when the optional ``kernels``
package (a Hub kernel for 4-bit matmuls) is absent, and then uses its own 4-bit kernel. PEFT
imports bitsandbytes whenever it is installed, so every LoRA run printed that warning once per
rank although nothing was quantized. hf_zero drops that one record; results are the same either
way (the fallback computes the same matmul), only a 4-bit base on such a CPU is slower without
``pip install kernels``.
"""

from __future__ import annotations

import logging

BNB_CPU_LOGGER = "bitsandbytes.backends.cpu.ops"
"""The logger bitsandbytes' CPU backend warns on."""


class _MissingKernelsFilter(logging.Filter):
    """Drops bitsandbytes' "Failed to load CPU gemm_4bit_forward from kernels-community"."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "kernels-community" not in str(record.msg)


def install() -> None:
    """Install the filters (idempotent); hf_zero calls this when it is imported."""
    logger = logging.getLogger(BNB_CPU_LOGGER)
    if not any(isinstance(f, _MissingKernelsFilter) for f in logger.filters):
        logger.addFilter(_MissingKernelsFilter())
