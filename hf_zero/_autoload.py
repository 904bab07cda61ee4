"""``HF_ZERO_CONFIG`` without a launcher change: the target of the ``hf_zero_autoload.pth`` hook.

``hf-zero autoload on`` writes a one-line ``.pth`` file into the environment's site-packages,
which Python runs at every start-up. The line itself reads one environment variable: with
``HF_ZERO_CONFIG`` unset it imports nothing, and once hf_zero is uninstalled (pip leaves the
file behind, as it did not install it) it finds no ``hf_zero`` and does nothing. Only when
``HF_ZERO_CONFIG`` is set and hf_zero is importable does it import this module, which adds an
import hook that, right after ``transformers`` is imported, calls `hf_zero.integrations.patching.activate`
(``transformers.Trainer`` becomes `ZeroTrainer` and ``accelerate.Accelerator`` becomes
`ZeroAccelerator`, configured from that file). ``HF_ZERO_AUTOLOAD=0`` turns it off for one
command.
"""

from __future__ import annotations

import os
import sys

PTH_NAME = "hf_zero_autoload.pth"
PTH_LINE = (
    "import os; os.environ.get('HF_ZERO_CONFIG') and "
    "__import__('importlib.util').util.find_spec('hf_zero') and "
    "__import__('hf_zero._autoload')\n"
)
"""Python runs ``.pth`` lines that start with ``import``; this one stops at the first falsy
step, so an unset variable or an uninstalled hf_zero costs nothing and prints nothing."""


class _AfterTransformers:
    """A meta-path finder that runs `hf_zero.integrations.patching.activate` once ``transformers`` has loaded."""

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
            from hf_zero.integrations.patching import activate
            from hf_zero.launch_errors import exit_with

            try:
                activate()
            except (ValueError, NotImplementedError) as error:
                exit_with(f"{error} (from HF_ZERO_CONFIG={os.environ.get('HF_ZERO_CONFIG')})")

        spec.loader.exec_module = exec_module
        return spec


def _wanted() -> bool:
    return bool(os.environ.get("HF_ZERO_CONFIG")) and os.environ.get("HF_ZERO_AUTOLOAD") != "0"


if _wanted() and "transformers" not in sys.modules:
    sys.meta_path.insert(0, _AfterTransformers())
