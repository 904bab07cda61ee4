"""A recipe run with one fault injected (tests/end_to_end/test_faults.py): ``HF_ZERO_TEST_FAULT`` is
``<what>@<checkpoint folder name>``, where ``what`` is

* ``kill-engine-save``: every rank's process group is SIGKILLed when rank 0 is about to publish
  the engine's shards of that checkpoint (model weights written, shards written, not renamed);
* ``kill-before-state``: likewise when rank 0 is about to write ``trainer_state.json``;
* ``enospc``: writing the engine's shards of that checkpoint fails with ENOSPC on rank 0, as a
  full disk makes it fail;
* ``enospc-model``: writing that checkpoint's streamed ``model.safetensors`` (stage 3) fails
  with ENOSPC on rank 0, while the other ranks take part in its gathers;
* ``stall``: rank 1 stops for ``<where>`` seconds before its second optimizer step (a rank
  stuck in I/O, swapped out, or stopped), while rank 0 goes on to the next collective;
* ``die``: rank 1 SIGKILLs itself before its second optimizer step (``<where>`` unused).

The recipe itself (``HF_ZERO_TEST_RECIPE``: ``finetune_lora`` or ``finetune_full``) runs
unchanged.
"""

import errno
import importlib
import os
import signal
import sys

import transformers

from hf_zero.engine import checkpointing as checkpoint  # the engine save's seams

what, where = os.environ["HF_ZERO_TEST_FAULT"].split("@")
rank0 = os.environ.get("RANK", "0") == "0"


def _kill_all() -> None:
    os.killpg(os.getpgid(0), signal.SIGKILL)  # the launcher and every rank, as a node dies


if what == "kill-engine-save" and rank0:
    publish = checkpoint.publish

    def publish_then_die(tmp, directory, *args, **kwargs):
        if where in str(directory):
            _kill_all()
        return publish(tmp, directory, *args, **kwargs)

    checkpoint.publish = publish_then_die

if what == "kill-before-state" and rank0:
    save_to_json = transformers.TrainerState.save_to_json

    def save_then_die(self, path):
        if where in str(path):
            _kill_all()
        return save_to_json(self, path)

    transformers.TrainerState.save_to_json = save_then_die

if what == "enospc" and rank0:
    original = checkpoint._write_safetensors

    def write_full(pieces, path):
        if where in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(pieces, path)

    checkpoint._write_safetensors = write_full

if what == "enospc-model" and rank0:
    from hf_zero.engine import pretrained_save

    streamed = pretrained_save.write_streamed

    def write_model_full(pieces, path, **kwargs):
        if where in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return streamed(pieces, path, **kwargs)

    pretrained_save.write_streamed = write_model_full

if what in ("stall", "die") and os.environ.get("RANK") == "1":
    import time

    from hf_zero.engine import ZeroEngine

    step, calls = ZeroEngine.step, []

    def faulty_step(self):
        calls.append(1)
        if len(calls) == 2:
            # When the fault starts, for benchmarks/bench_faults.py's time to detection.
            print(f"hf_zero test fault: {what} at {time.time():.3f}", file=sys.stderr, flush=True)
            if what == "die":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(float(where))
        return step(self)

    ZeroEngine.step = faulty_step

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "recipes"))
importlib.import_module(os.environ["HF_ZERO_TEST_RECIPE"]).main()
