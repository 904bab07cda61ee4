"""``HF_ZERO_CONFIG`` without a launcher change: the target of the ``hf_zero_autoload.pth`` hook.

``hf-zero autoload on`` writes a one-line ``.pth`` file (``import hf_zero._autoload``) into the
environment's site-packages, which Python runs at every start-up. This module then costs an
environment lookup; only when ``HF_ZERO_CONFIG`` is set does it add an import hook that, right
after ``transformers`` is imported, calls `hf_zero.run.activate` (``transformers.Trainer`` becomes
`ZeroTrainer`, configured from that file). ``HF_ZERO_AUTOLOAD=0`` turns it off for one command.
"""

from __future__ import annotations

import os
import sys

PTH_NAME = "hf_zero_autoload.pth"
PTH_LINE = "import hf_zero._autoload\n"


class _AfterTransformers:
    """A meta-path finder that runs `hf_zero.run.activate` once ``transformers`` has loaded."""

    def find_spec(self, name, path=None, target=None):
        if name != "transformers":
            return None
        import importlib.util

        sys.meta_path.remove(self)  # find the real spec with the remaining finders
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            from hf_zero.run import activate

            activate()

        spec.loader.exec_module = exec_module
        return spec


def _wanted() -> bool:
    return bool(os.environ.get("HF_ZERO_CONFIG")) and os.environ.get("HF_ZERO_AUTOLOAD") != "0"


if _wanted() and "transformers" not in sys.modules:
    sys.meta_path.insert(0, _AfterTransformers())
