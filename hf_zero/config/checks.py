"""One config value checked and normalised: the shared error messages of `ZeroConfig.validate`.

Each check raises ``ValueError`` naming the key, the value and what is allowed.
"""

from __future__ import annotations

import contextlib
import difflib
import math
from typing import Any

AUTO = "auto"
"""The value that leaves a setting to hf_zero (as DeepSpeed's ``"auto"``)."""


def suggest(key: str, options: set[str]) -> str:
    """``"; did you mean 'x'?"`` for the closest allowed key, or nothing."""
    close = difflib.get_close_matches(str(key), sorted(options), n=1, cutoff=0.5)
    return f"; did you mean '{close[0]}'?" if close else ""


def frozen_storage(value: Any) -> bool | str:
    """``quantized_nontrainable_weights`` normalised: ``True`` (hf_zero's INT8/INT4 blocks; also
    ``"int8"`` and ``"true"``), ``False``, ``"nf4"`` or ``"fp4"`` (bitsandbytes' formats)."""
    if isinstance(value, str) and value.lower() in ("true", "false", "int8"):
        value = value.lower() != "false"
    if not (isinstance(value, bool) or value in ("nf4", "fp4")):
        raise ValueError(
            f"zero config: 'quantized_nontrainable_weights' = {value!r} is not allowed; "
            "expected true/false, 'int8' (hf_zero's INT8 blocks), 'nf4' or 'fp4' "
            "(bitsandbytes' 4-bit formats)"
        )
    return value


def one_of(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed or isinstance(value, bool):
        shown = ", ".join(repr(a) for a in allowed)
        raise ValueError(
            f"zero config: '{name}' = {value!r} is not allowed; expected one of {shown}"
        )


def at_least(name: str, value: Any, minimum: float) -> None:
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not is_number or math.isnan(value) or value < minimum:
        kind = "an integer" if isinstance(minimum, int) else "a number"
        raise ValueError(f"zero config: '{name}' = {value!r} must be {kind} >= {minimum}")
    if isinstance(minimum, int) and not isinstance(value, int):
        raise ValueError(f"zero config: '{name}' = {value!r} must be an integer >= {minimum}")


def int_or_auto(name: str, value: Any, minimum: int) -> int | str:
    """Validate and normalise: DeepSpeed files often write sizes as floats like ``5e8``."""
    if value == AUTO:
        return value
    if isinstance(value, str):
        # YAML 1.1 reads "5e7" as a string.
        with contextlib.suppress(ValueError):
            value = float(value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(
            f"zero config: '{name}' = {value!r} must be an integer >= {minimum} or 'auto'"
        )
    return value
