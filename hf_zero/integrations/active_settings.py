"""The settings `hf_zero.integrations.patching.activate` was given, for the Trainer and the
Accelerator the script builds later in the same process."""

from __future__ import annotations

from typing import Any

_active: tuple[dict[str, Any], str | None] | None = None


def remember(values: dict[str, Any], config_file: str | None) -> None:
    global _active
    _active = (dict(values), config_file)


def active_sources() -> tuple[dict[str, Any], str | None]:
    """The flags and ``--zero_config`` file `activate` was given (empty when not active)."""
    return _active if _active is not None else ({}, None)
