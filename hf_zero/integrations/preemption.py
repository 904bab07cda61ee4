"""``save_on_sigterm``: a pre-empted Trainer run saves a checkpoint and exits 0.

Cluster schedulers send SIGTERM and, some seconds later (Slurm's ``KillWait``, Kubernetes'
``terminationGracePeriodSeconds``: 30 s by default; torchrun, receiving it, passes SIGTERM on to
its workers and kills them 30 s later), SIGKILL. By default the process ends at SIGTERM and loses
the steps since the last checkpoint. With the setting on:

1. the handler only notes the signal (the step in flight goes on: a collective cannot be left
   half-done);
2. at the end of each optimizer step every rank learns whether any rank got SIGTERM (one
   one-element all-reduce: the signal may reach the ranks at different steps, and all of them
   must stop at the same one);
3. the Trainer then saves a checkpoint, whatever its save strategy, and stops;
4. once the checkpoint is published, the process exits with status 0. A restart with
   ``--resume_from_checkpoint auto`` continues from that step, so no step is lost.

A second SIGTERM while this runs ends the process as the first would have without the setting.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from transformers import TrainerCallback

from hf_zero.integrations.agreement import any_rank


class SaveOnSigterm(TrainerCallback):
    """Trainer callback for ``save_on_sigterm`` (a no-op for engines without the setting)."""

    def __init__(self) -> None:
        self.received_at: float | None = None
        self.stopping = False
        self._previous = None
        self._on = False

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        engine = getattr(model, "_hf_zero_engine", None)
        self._on = bool(engine is not None and engine.config.save_on_sigterm)
        if self._on and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._note)

    def _note(self, signum, frame) -> None:
        if self.received_at is not None:  # a second one: what SIGTERM did before
            signal.signal(signal.SIGTERM, self._previous or signal.SIG_DFL)
            signal.raise_signal(signal.SIGTERM)
            return
        self.received_at = time.monotonic()
        if os.environ.get("RANK", "0") == "0":
            _say(
                "SIGTERM received: finishing this step, then saving a checkpoint (save_on_sigterm)"
            )

    def on_step_end(self, args, state, control, **kwargs):
        if self._on and any_rank(self.received_at is not None):
            self.stopping = True
            control.should_save = True
            control.should_training_stop = True
        return control

    def on_save(self, args, state, control, **kwargs):
        if not self.stopping:
            return control
        took = (
            f" {time.monotonic() - self.received_at:.1f} s after SIGTERM"
            if self.received_at
            else ""
        )
        if args.process_index == 0:
            _say(
                f"saved checkpoint-{state.global_step} (step {state.global_step} of "
                f"{state.max_steps}){took}; exiting with status 0. Continue with "
                "--resume_from_checkpoint auto"
            )
        sys.exit(0)

    def on_train_end(self, args, state, control, **kwargs):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


def _say(message: str) -> None:
    print(f"hf_zero: {message}", file=sys.stderr, flush=True)
