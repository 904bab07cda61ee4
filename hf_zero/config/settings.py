"""The settings hf_zero takes from the command line: one table, from which the `hf_zero.run` flags,
the `ZeroTrainingArguments` fields, the recipes' flags, ``hf-zero config --flags`` and the flag
list in docs/CONFIG.md are all made (`tests/config/test_config.py` checks they agree).

The naming rule: a flag is ``--zero_`` followed by the config key it sets (``--zero_stage`` sets
``stage``, ``--zero_offload_optimizer`` sets ``offload_optimizer``), plus ``--zero_config FILE``
for a whole file. Earlier spellings without the prefix (``--offload_optimizer``, ``--tp_size``,
...) still work as aliases.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hf_zero.config.checks import AUTO

_TRUE = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def parse_bool(text: str) -> bool:
    if text.lower() not in _TRUE:
        raise ValueError(f"expected true or false, got {text!r}")
    return _TRUE[text.lower()]


def parse_bool_or_format(text: str) -> bool | str:
    """MixZ++: true/false, or a storage format ('int8', 'nf4', 'fp4')."""
    return text.lower() if text.lower() in ("int8", "nf4", "fp4") else parse_bool(text)


def parse_int_or_auto(text: str) -> int | str:
    return text if text == AUTO else int(text)


@dataclass(frozen=True)
class Setting:
    """One command-line setting: the config key it sets, how its text is read, its help."""

    key: str
    kind: type
    """The value's type (the Trainer argument's field type)."""
    parse: Callable[[str], Any]
    help: str
    aliases: tuple[str, ...] = ()

    @property
    def flag(self) -> str:
        """The flag's name without ``--`` (the naming rule: ``zero_`` + the key)."""
        return f"zero_{self.key}"

    @property
    def names(self) -> tuple[str, ...]:
        """Every accepted spelling, the canonical one first."""
        return (self.flag, *self.aliases)


SETTINGS: tuple[Setting, ...] = (
    Setting("stage", int, int, "ZeRO stage: 0, 1, 2 or 3 (default: from --zero_config)"),
    Setting(
        "offload_optimizer",
        str,
        str,
        "'cpu' (stages 1-3) or 'nvme' (stage 3): master weights and optimizer state there",
        ("offload_optimizer",),
    ),
    Setting(
        "offload_optimizer_ratio",
        float,
        float,
        "with --zero_offload_optimizer cpu: the share of the optimizer on the host (0 to 1)",
    ),
    Setting(
        "offload_param",
        str,
        str,
        "'cpu' or 'nvme' (stage 3): parameter shards there",
        ("offload_param",),
    ),
    Setting(
        "master_weights_dtype",
        str,
        str,
        "'bf16' (bf16 runs): the bf16 parameters are the master weights, no fp32 copy",
    ),
    Setting(
        "optimizer_states_dtype",
        str,
        str,
        "'bf16' (bf16 runs): Adam's moments kept in bf16 between steps",
    ),
    Setting("nvme_path", str, str, "directory for NVMe swap files (ZeRO-Infinity)", ("nvme_path",)),
    Setting("quantized_weights", bool, parse_bool, "ZeRO++ qwZ: INT8 weight all-gather (stage 3)"),
    Setting(
        "hpz_partition_size",
        int,
        parse_int_or_auto,
        "ZeRO++ hpZ: secondary partition size (stage 3)",
    ),
    Setting("quantized_gradients", bool, parse_bool, "ZeRO++ qgZ: quantized gradient reduction"),
    Setting(
        "quantized_nontrainable_weights",
        str,
        parse_bool_or_format,
        "MixZ++ (stage 3): frozen weights kept as quantized shards: true/int8 (INT8 blocks), "
        "nf4 or fp4 (bitsandbytes 4-bit), false",
    ),
    Setting("tp_size", int, int, "tensor-parallel size (AutoTP)", ("tp_size",)),
    Setting(
        "sp_size",
        int,
        int,
        "Ulysses sequence parallelism: ranks sharing each sequence (1/sp of it each)",
    ),
    Setting(
        "tiled_logits",
        str,
        str,
        "head and loss over tiles of tokens: true, false or auto (tile when logits > 256 MiB)",
    ),
    Setting(
        "tiled_mlp", bool, parse_bool, "MLPs over tiles of the sequence, recomputed in backward"
    ),
    Setting(
        "offload_checkpoints",
        bool,
        parse_bool,
        "with --gradient_checkpointing: each layer's saved inputs in host memory",
    ),
    Setting(
        "host_memory",
        str,
        str,
        "training on CPU: release (freed memory back after each step that frees 16 MiB or "
        "more), unmap (each freed buffer >= 1 MiB back at once: the lowest peak) or reuse "
        "(kept: faster)",
    ),
    Setting(
        "save_on_sigterm",
        bool,
        parse_bool,
        "Trainer: on SIGTERM finish the step, save a checkpoint and exit 0 (pre-emption)",
    ),
    Setting(
        "profile",
        bool,
        parse_bool,
        "record memory by object and time by phase for a few steps (read: hf-zero doctor)",
    ),
    Setting(
        "pp_size",
        int,
        int,
        "pipeline stages (--gradient_accumulation_steps micro-batches a step)",
        ("pp_size",),
    ),
    Setting(
        "pp_schedule",
        str,
        str,
        "pipeline schedule: gpipe, 1f1b or interleaved_1f1b",
        ("pp_schedule",),
    ),
)

CONFIG_FILE_FLAG = "zero_config"
"""``--zero_config FILE``: an hf_zero YAML/JSON or a DeepSpeed JSON."""
CONFIG_FILE_HELP = "hf_zero YAML/JSON or a DeepSpeed JSON config file"

FLAG_KEYS: dict[str, str] = {name: s.key for s in SETTINGS for name in s.names}
"""Every accepted flag name (without ``--``) -> the config key it sets."""


def setting(key: str) -> Setting:
    return next(s for s in SETTINGS if s.key == key)


def merge_spellings(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """``{flag name: value}`` (``None`` = not given) -> ``({key: value}, {key: the flag as
    given})``. Two spellings of one setting with different values raise ``ValueError``."""
    merged: dict[str, Any] = {}
    given_as: dict[str, str] = {}
    for name, value in values.items():
        if value is None or name not in FLAG_KEYS:
            continue
        key = FLAG_KEYS[name]
        if key in merged and merged[key] != value:
            raise ValueError(
                f"hf_zero: --{given_as[key]} {merged[key]!r} and --{name} {value!r} set "
                f"'{key}' twice; give one of them"
            )
        merged[key], given_as[key] = value, name
    return merged, given_as


def add_flags(parser, keys: tuple[str, ...] | None = None) -> None:
    """Add the settings ``keys`` (default: all) and ``--zero_config`` to an ``argparse``
    parser, canonical spelling and aliases alike; `merge_spellings` reads them back."""
    parser.add_argument(f"--{CONFIG_FILE_FLAG}", default=None, help=CONFIG_FILE_HELP)
    for s in SETTINGS:
        if keys is None or s.key in keys:
            for name in s.names:
                help_text = s.help if name == s.flag else f"= --{s.flag}"
                parser.add_argument(f"--{name}", type=s.parse, default=None, help=help_text)


def flags_markdown() -> str:
    """The flag table docs/CONFIG.md shows (and ``hf-zero config --flags`` prints)."""
    rows = ["| flag | sets | also accepted | what |", "|---|---|---|---|"]
    rows.append(
        f"| `--{CONFIG_FILE_FLAG} FILE` | (a whole file) | | an hf_zero YAML/JSON or a "
        "DeepSpeed JSON; the flags below win over it, and must agree with what it sets |"
    )
    for s in SETTINGS:
        also = ", ".join(f"`--{a}`" for a in s.aliases)
        rows.append(f"| `--{s.flag}` | `{s.key}` | {also} | {s.help} |")
    return "\n".join(rows) + "\n"
