"""Reading a settings file: YAML or JSON, with the file and line named in every error."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml


def read_mapping(path: str | Path) -> dict[str, Any]:
    """The mapping a YAML or JSON file holds; a ``ValueError`` names the file (and the line of a
    syntax error) when it is missing, unreadable or not a mapping."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"zero config: file '{path}' does not exist")
    text = path.read_text()
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"zero config: {path}:{error.lineno}:{error.colno}: not valid JSON ({error.msg})"
        ) from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ValueError(f"zero config: {where}: not valid YAML ({problem})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"zero config: '{path}' must hold a mapping, got {type(data).__name__}")
    return data
