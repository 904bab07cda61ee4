"""Settings from several places at once: command-line flags > a ``--zero_config`` file >
``$HF_ZERO_CONFIG``, as the Trainer arguments, `hf_zero.run` and `ZeroAccelerator` read them."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hf_zero.config.checks import AUTO
from hf_zero.config.settings import SETTINGS
from hf_zero.config.zero_config import ZeroConfig, check_keys, read_mapping, values_of

ENV_VAR = "HF_ZERO_CONFIG"


def explicit_values(source: Mapping | str | Path | None) -> dict[str, Any]:
    """The fields a file or dict sets explicitly (validated key by key), hf_zero or DeepSpeed."""
    if source is None:
        return {}
    raw = read_mapping(source) if isinstance(source, (str, Path)) else dict(source)
    return values_of(raw)


def resolve_sources(
    cli: Mapping[str, Any],
    config_file: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    flag_names: Mapping[str, str] | None = None,
    precision_from_run: bool = False,
) -> ZeroConfig:
    """Merge settings with precedence command line > ``config_file`` > ``$HF_ZERO_CONFIG``.

    ``cli`` maps field names to values (``None`` = not given); ``flag_names`` maps a field to
    the flag it was given as (for messages; default: the canonical flags). A command-line value that
    contradicts a value the ``--zero_config`` file sets explicitly raises ``ValueError`` naming
    both; a file that overrides ``$HF_ZERO_CONFIG`` only warns. All checks run before any
    process-group work. ``precision_from_run``: a precision no source sets is ``"auto"``, to be
    filled from the run's own flags (the Trainer's ``--bf16``), so that keys which need a 16-bit
    run are not checked against the fp32 default before those flags are read.
    """
    env = os.environ if env is None else env
    flag_names = flag_names or {s.key: s.flag for s in SETTINGS}
    env_file = env.get(ENV_VAR) or None
    from_env = explicit_values(env_file)
    from_file = explicit_values(config_file)
    given = {k: v for k, v in cli.items() if v is not None}
    check_keys(given)
    for key in sorted(given.keys() & from_file.keys()):
        if given[key] != from_file[key]:
            flag = flag_names.get(key, key)
            raise ValueError(
                f"hf_zero: --{flag} {given[key]!r} contradicts '{key}' = {from_file[key]!r} in "
                f"{config_file}; change one of them (the command line would win, but a silent "
                "override hides mistakes)"
            )
    overridden = [
        k for k in sorted(from_file.keys() & from_env.keys()) if from_file[k] != from_env[k]
    ]
    if overridden:
        warnings.warn(
            f"hf_zero: {config_file} overrides {ENV_VAR}={env_file} for {overridden}", stacklevel=2
        )
    merged = {**from_env, **from_file, **given}
    if precision_from_run and merged.get("precision") is None:
        merged["precision"] = AUTO
    return ZeroConfig(**merged)
