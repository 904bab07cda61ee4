"""A training process's exit (`hf_zero.engine.process_exit`): an engine's start makes the exit
collect garbage once and freeze the rest, and garbage that exists at exit is still finalized."""

import subprocess
import sys
import textwrap

from hf_zero.testing import free_port

# Runs in a fresh interpreter: a checker registered first runs last (atexit runs in reverse), so it
# sees what the engine's exit handler left.
ENGINE_EXIT = """
import atexit, gc, os
import torch
atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count() > 0, flush=True))
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}", RANK="0", WORLD_SIZE="1")
import hf_zero
from hf_zero.tiny import tiny_llama
model = tiny_llama(0)
hf_zero.initialize(model, torch.optim.AdamW(model.parameters()), stage=3)
print("frozen before exit:", gc.get_freeze_count() > 0, flush=True)
"""

GARBAGE_AT_EXIT = """
import gc, sys
from hf_zero.engine.process_exit import collect_once_at_exit

gc.disable()  # no automatic collection before exit: only the exit can free the cycle below

class Flushed:
    def __del__(self):
        with open(sys.argv[1], "w") as f:
            f.write("finalized")

collect_once_at_exit()
a, b = Flushed(), Flushed()
a.other, b.other = b, a  # a reference cycle: only the garbage collector frees it
del a, b
"""


def _python(code: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_an_engine_makes_its_process_freeze_the_heap_at_exit_not_before():
    out = _python(ENGINE_EXIT.format(port=free_port()))
    assert "frozen before exit: False" in out and "frozen at exit: True" in out, out


def test_garbage_cycles_that_exist_at_exit_are_still_finalized(tmp_path):
    marker = tmp_path / "marker"
    _python(GARBAGE_AT_EXIT, str(marker))
    assert marker.read_text() == "finalized"
