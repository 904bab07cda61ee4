"""Translating DeepSpeed's parallelism sections, ``tensor_parallel.partition_config`` and
``pipeline``, into hf_zero config values (`deepspeed.from_deepspeed` calls these)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from hf_zero.config.checks import AUTO, suggest

_PARTITION_TYPES = {"column": "colwise", "row": "rowwise", "skip": None}


def pipeline_values(values: dict[str, Any]) -> None:
    """DeepSpeed's ``stages: auto`` leaves ``pp_size`` to hf_zero's config; its ``best``
    partition is hf_zero's parameter balancing; ``type:REGEX`` has no counterpart."""
    if values.get("pp_size") == AUTO:
        del values["pp_size"]
    partition = values.get("pp_partition")
    if partition == "best":
        values["pp_partition"] = "parameters"
    elif isinstance(partition, str) and partition.startswith("type:"):
        raise ValueError(
            f"deepspeed config: 'pipeline.partition' = {partition!r} (balance layers of a "
            "class) is not supported; allowed: 'parameters' (or 'best'), 'uniform', or a list "
            "of layer counts per stage"
        )


def tp_plan_from_partition_config(section: Mapping) -> dict[str, str]:
    """DeepSpeed AutoTP ``layer_specs`` (parameter regexes, row/column) -> hf_zero ``tp_plan``."""
    allowed = {"use_default_specs", "layer_specs"}
    for key in section:
        if key not in allowed:
            raise ValueError(
                f"deepspeed config: unknown key 'tensor_parallel.partition_config.{key}'"
                f"{suggest(key, allowed)}. Allowed here: {', '.join(sorted(allowed))}"
            )
    plan = {}
    for spec in section.get("layer_specs", []):
        kind = spec.get("partition_type")
        if kind not in _PARTITION_TYPES:
            raise ValueError(
                f"deepspeed config: 'partition_type' = {kind!r} is not supported; allowed: "
                + ", ".join(repr(k) for k in _PARTITION_TYPES)
            )
        for pattern in spec.get("patterns", []):
            # DeepSpeed matches parameter names (``...o_proj.weight``); hf_zero matches modules.
            module_pattern = re.sub(r"(\\?\.weight)?\$?$", "", pattern)
            if _PARTITION_TYPES[kind]:
                plan[module_pattern] = _PARTITION_TYPES[kind]
    return plan
