"""A mistake in the arguments is one line, printed once, not a traceback from every rank.

Every launched process parses the same arguments and so hits the same mistake. Rank 0 says it;
the others exit with the same status silently, but only after giving rank 0 time to say it: the
launcher stops every process as soon as one fails, and a silent rank that got there first had
rank 0 killed before it printed anything (seen in CI). (The launcher, ``torchrun`` /
``accelerate launch``, then adds its own summary of the failed processes: that part is not ours
to change.)
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

T = TypeVar("T")

USAGE_STATUS = 2
"""Exit status for a usage or configuration mistake (as argparse uses)."""


def is_rank_zero() -> bool:
    """Rank 0 of the launch (or an unlaunched process): the one that reports."""
    return os.environ.get("RANK", "0") == "0"


def report(message: str) -> None:
    """Print ``error: message`` on rank 0 only."""
    if is_rank_zero():
        print(f"error: {message}", file=sys.stderr, flush=True)


RANK_ZERO_GRACE_S = 30.0
"""How long a silent rank waits for rank 0 to report the same mistake and end the launch."""


def wait_for_rank_zero_report() -> None:
    """On ranks other than 0 under a launcher: wait before exiting, so that rank 0 (which hits
    the same mistake) reports it first; the launcher then stops this process."""
    if not is_rank_zero():
        time.sleep(RANK_ZERO_GRACE_S)


def exit_with(message: str, status: int = USAGE_STATUS) -> NoReturn:
    """`report` the message, then exit every rank with ``status``."""
    report(message)
    wait_for_rank_zero_report()
    sys.exit(status)


def parse_or_exit(parse: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run an argument parser; a mistake (argparse's, or a ``ValueError`` /
    ``NotImplementedError`` from validating the values) is one line on rank 0 and exit 2.

    argparse prints its whole usage before its error; for the Trainer's arguments that is over a
    hundred lines above the one that matters, so only the error line is kept (``--help`` still
    prints everything).
    """
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            result = parse(*args, **kwargs)
    except (ValueError, NotImplementedError) as error:
        exit_with(str(error))
    except SystemExit as stop:  # argparse's usage errors (status 2); --help exits 0
        if stop.code in (0, None):
            sys.stderr.write(captured.getvalue())
            raise
        lines = [line for line in captured.getvalue().splitlines() if line.strip()]
        error = lines[-1] if lines else "invalid arguments"
        error = error.split(": error: ", 1)[-1]
        exit_with(f"{error} (--help lists the arguments)", stop.code)
    sys.stderr.write(captured.getvalue())  # warnings printed while parsing
    return result
