"""Checks of the long-sequence settings (`hf_zero.sequence`): each error names the key, the value
and what is allowed."""

from __future__ import annotations

from typing import Any

from hf_zero.config.checks import AUTO, at_least, int_or_auto


def _switch(name: str, value: Any, allow_auto: bool) -> bool | str:
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if isinstance(value, bool) or (allow_auto and value == AUTO):
        return value
    allowed = "true, false or 'auto'" if allow_auto else "true or false"
    raise ValueError(f"zero config: '{name}' = {value!r} is not allowed; expected {allowed}")


def check_sequence_settings(config) -> None:
    """Validate and normalise ``sp_size``, ``tiled_logits``, ``tiled_mlp``, their tile sizes and
    ``offload_checkpoints``;
    refuse what sequence parallelism does not compose with."""
    at_least("sp_size", config.sp_size, 1)
    config.tiled_logits = _switch("tiled_logits", config.tiled_logits, allow_auto=True)
    config.tiled_mlp = _switch("tiled_mlp", config.tiled_mlp, allow_auto=False)
    config.offload_checkpoints = _switch(
        "offload_checkpoints", config.offload_checkpoints, allow_auto=False
    )
    config.logits_tile_tokens = int_or_auto("logits_tile_tokens", config.logits_tile_tokens, 1)
    config.mlp_tile_tokens = int_or_auto("mlp_tile_tokens", config.mlp_tile_tokens, 1)
    if config.sp_size > 1:
        for name in ("tp_size", "pp_size"):
            if getattr(config, name) > 1:
                raise ValueError(
                    f"zero config: 'sp_size' = {config.sp_size} with '{name}' = "
                    f"{getattr(config, name)}: sequence parallelism does not combine with "
                    f"{'AutoTP' if name == 'tp_size' else 'pipeline stages'} yet; set one to 1"
                )
