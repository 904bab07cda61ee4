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
from collections.abc import Callable, Iterator
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


@contextlib.contextmanager
def quiet_unless_rank_zero() -> Iterator[None]:
    """Silence stderr on ranks other than 0 (argparse prints its usage errors there)."""
    if is_rank_zero():
        yield
        return
    with contextlib.redirect_stderr(io.StringIO()):
        yield


def parse_or_exit(parse: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run an argument parser; a mistake (argparse's, or a ``ValueError`` /
    ``NotImplementedError`` from validating the values) is one line on rank 0 and exit 2."""
    try:
        with quiet_unless_rank_zero():
            return parse(*args, **kwargs)
    except (ValueError, NotImplementedError) as error:
        exit_with(str(error))
    except SystemExit as stop:  # argparse's usage errors (status 2); --help exits 0
        if stop.code not in (0, None):
            wait_for_rank_zero_report()
        raise
