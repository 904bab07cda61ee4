"""Run an unmodified Trainer script with hf_zero: ``python -m hf_zero.run script.py ARGS``.

    hf-zero run train.py --output_dir out --zero_stage 3            # one process
    torchrun --nproc_per_node 2 -m hf_zero.run train.py ... --zero_stage 3
    accelerate launch --config_file c.yaml -m hf_zero.run train.py ... --zero_stage 3

hf_zero's flags (``--zero_<key>`` for each setting of `hf_zero.config.settings.SETTINGS`, such as
``--zero_stage 3``, their older spellings, and ``--zero_config FILE``; ``hf-zero config --flags``
lists them) are taken out of the argument list, so the script's own parser never sees them;
they are validated before the script starts, and a mistake is one line on rank 0 (exit status 2).
Then the script runs as ``__main__`` with these changes, and only these:

* the names ``transformers.Trainer`` / ``transformers.trainer.Trainer`` point at `ZeroTrainer`
  (a subclass of the original): every Trainer the script builds - including subclasses it
  defines and TRL's trainers, which subclass ``transformers.Trainer`` when they are imported -
  uses hf_zero's engine and its save/load paths;
* the names ``accelerate.Accelerator`` / ``accelerate.accelerator.Accelerator`` point at
  `ZeroAccelerator` (a subclass), for custom Accelerate loops;
* without a GPU, ``ACCELERATE_USE_CPU=true``: the launched processes form one gloo group, as
  ``--use_cpu`` / ``accelerate launch --cpu`` would make them (see `hf_zero.integrations.cpu`);
  and ``TrainingArguments.__post_init__`` sets ``use_cpu`` first, as ``--use_cpu`` would, so
  ``--bf16`` (TRL's default) passes transformers' own GPU check;
* the script's ``--ddp_timeout``, if given, is the CPU group's timeout (transformers leaves it
  out on CPU).

If flags were given but the script never built a Trainer or an Accelerator (so hf_zero never
ran), the command fails with a message saying so. A script run without this module behaves
exactly as stock transformers.

``HF_ZERO_CONFIG=f.yaml`` alone does the same for commands you cannot change, once
``hf-zero autoload on`` has put a one-line ``.pth`` hook into the environment (see
`hf_zero._autoload`); ``hf-zero autoload off`` removes it.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import Any

from hf_zero.config.settings import CONFIG_FILE_FLAG, SETTINGS, merge_spellings, parse_bool
from hf_zero.integrations.cpu import create_launched_group
from hf_zero.integrations.patching import activate, hf_zero_was_used
from hf_zero.launch_errors import USAGE_STATUS, report, wait_for_rank_zero_report

FLAGS: dict[str, tuple[str, Any]] = {
    **{f"--{name}": (s.key, s.parse) for s in SETTINGS for name in s.names},
    f"--{CONFIG_FILE_FLAG}": ("", str),
}
"""--flag -> (config key, parser for its text), from `hf_zero.config.settings.SETTINGS`."""
BOOLEAN_FLAGS = {f for f, (_, parse) in FLAGS.items() if parse is parse_bool}

NOT_USED_STATUS = 3
"""Exit status when hf_zero flags were given but the script built no Trainer or Accelerator."""


def split_flags(argv: list[str]) -> tuple[dict[str, Any], str | None, list[str]]:
    """``(config values, --zero_config path, the rest)``; ``--flag value`` and ``--flag=value``.

    A boolean flag given without a value means true. Raises ``ValueError`` naming a bad value.
    """
    by_name: dict[str, Any] = {}
    config_file = None
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        flag, eq, inline = arg.partition("=")
        if flag not in FLAGS:
            rest.append(arg)
            i += 1
            continue
        if eq:
            text, i = inline, i + 1
        elif flag in BOOLEAN_FLAGS and (i + 1 == len(argv) or argv[i + 1].startswith("--")):
            text, i = "true", i + 1
        elif i + 1 < len(argv):
            text, i = argv[i + 1], i + 2
        else:
            raise ValueError(f"hf_zero run: {flag} needs a value")
        parse = FLAGS[flag][1]
        try:
            value = parse(text)
        except ValueError as error:
            raise ValueError(f"hf_zero run: {flag} {text!r}: {error}") from None
        if flag == f"--{CONFIG_FILE_FLAG}":
            config_file = value
        elif by_name.get(flag[2:], value) != value:
            raise ValueError(f"hf_zero run: {flag} given twice ({by_name[flag[2:]]!r}, {value!r})")
        else:
            by_name[flag[2:]] = value
    values, _ = merge_spellings(by_name)
    return values, config_file, rest


def fail(message: str, status: int = USAGE_STATUS) -> int:
    """Print ``error: message`` once (rank 0) and return ``status`` for ``sys.exit`` (other
    ranks first give rank 0 time to print it: `wait_for_rank_zero_report`)."""
    report(message)
    wait_for_rank_zero_report()
    return status


def ddp_timeout_of(script_args: list[str]) -> float | None:
    """The script's own ``--ddp_timeout`` value, if it is given one (a Trainer flag)."""
    for i, arg in enumerate(script_args):
        value = None
        if arg == "--ddp_timeout" and i + 1 < len(script_args):
            value = script_args[i + 1]
        elif arg.startswith("--ddp_timeout="):
            value = arg.split("=", 1)[1]
        if value is not None:
            try:
                return float(value)
            except ValueError:
                return None  # the script's own parser reports it
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    scripts = [i for i, arg in enumerate(argv) if arg.endswith(".py") and not arg.startswith("-")]
    if argv and argv[0].startswith("-") and scripts:  # hf_zero flags before the script
        argv = argv[scripts[0] :] + argv[: scripts[0]]
    if not argv or argv[0].startswith("-"):
        print(
            "usage: python -m hf_zero.run SCRIPT.py [script args] [hf_zero flags]\n"
            "hf_zero run: error: no script (a .py file) was given",
            file=sys.stderr,
        )
        return 2
    script, *rest = argv
    try:
        values, config_file, script_args = split_flags(rest)
        activate(values, config_file)
    except (ValueError, NotImplementedError) as error:
        return fail(str(error))
    if not os.path.isfile(script):
        return fail(f"hf_zero run: no such script: {script}")
    sys.argv = [script, *script_args]
    # The script's TrainingArguments would create the CPU group without its --ddp_timeout, and
    # on torch's own store, which a restarted round cannot always form again.
    create_launched_group(None, ddp_timeout_of(script_args))
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    from hf_zero.integrations.start_checks import StartRefused

    try:
        runpy.run_path(script, run_name="__main__")
    except StartRefused as refusal:  # an unwritable --output_dir, another run's folder, ...
        return fail(str(refusal))
    if (values or config_file) and not hf_zero_was_used():
        flag_of = {s.key: s.flag for s in SETTINGS}
        given = [f"--{flag_of[name]} {value}" for name, value in values.items()]
        given += [f"--zero_config {config_file}"] if config_file else []
        given = ", ".join(given)
        return fail(
            f"hf_zero run: {given} were given, but {script} finished without building a "
            "transformers Trainer or an accelerate Accelerator, so hf_zero never ran. "
            "hf_zero.run reaches scripts that use one of those two; for a bare torch loop call "
            "hf_zero.initialize() yourself.",
            NOT_USED_STATUS,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
