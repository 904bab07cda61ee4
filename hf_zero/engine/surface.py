"""`Engine`: what every engine `initialize` returns can do, and what only one kind can.

=============================================  ==========  ==============  ======================
call                                           ZeroEngine  PipelineEngine  notes
=============================================  ==========  ==============  ======================
``train_batch(batch)``                         yes         yes             one optimizer step
``eval_batch(batch)``                          yes         yes             the loss, no step
``save_checkpoint`` / ``load_checkpoint``      yes         yes             atomic; resharded
``full_state_dict`` / ``saved_state_dict``     yes         yes             whole, on rank 0
``save_pretrained(dir)``                       yes         raises          streamed, group by group
``memory_report()`` / ``comm_stats``           yes         yes
``clip_grad_norm_`` / ``no_sync()``            yes         yes
``close()``                                    yes         yes             swap files removed
``engine(batch)``, ``backward``, ``step``,     yes         raises          a pipeline runs them
``zero_grad``, ``gathered_parameters``                                     inside ``train_batch``
=============================================  ==========  ==============  ======================

``batch`` is a mapping of the model's forward arguments (``input_ids``, ``attention_mask``,
``labels``) holding this data-parallel rank's samples; both engines cut it along the first
dimension into micro-batches and return the mean micro-batch loss.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

Batch = Mapping[str, torch.Tensor]


class Engine(abc.ABC):
    """The surface both engines share (see the module's table)."""

    is_pipeline = False
    """True for `PipelineEngine`: integrations drive it by `train_batch` alone."""

    @abc.abstractmethod
    def train_batch(self, batch: Batch, microbatches: int | None = None) -> float:
        """One optimizer step on ``batch``, cut into ``microbatches``; the mean loss."""

    @abc.abstractmethod
    def eval_batch(self, batch: Batch, microbatches: int | None = None) -> float:
        """The mean micro-batch loss on ``batch``, without gradients or a step."""

    @abc.abstractmethod
    def save_checkpoint(self, directory: str | Path, keep_last: int | None = None) -> None:
        """Write a checkpoint atomically (collective)."""

    @abc.abstractmethod
    def load_checkpoint(self, directory: str | Path) -> None:
        """Resume from `save_checkpoint`'s folder (collective)."""

    @abc.abstractmethod
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights on rank 0 (``{}`` elsewhere; collective)."""

    @abc.abstractmethod
    def saved_state_dict(self) -> dict[str, torch.Tensor]:
        """What a saved model holds (collective; ``{}`` off rank 0)."""

    @abc.abstractmethod
    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds now, by kind."""

    @property
    @abc.abstractmethod
    def comm_stats(self) -> Any:
        """Bytes moved by hf_zero's collectives on this rank (`hf_zero.comm.stats.CommStats`)."""

    @abc.abstractmethod
    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip the global gradient norm; the norm before clipping."""

    @abc.abstractmethod
    def no_sync(self):
        """A context that skips gradient communication where the engine can."""

    swaps: dict = {}
    """ZeRO-Infinity: this rank's swap spaces by NVMe tier (`hf_zero.storage.swap.SwapSpace`)."""
    watchdog: Any = None

    def close(self) -> None:
        """Remove this rank's NVMe swap files (done at exit too; another engine of this process
        on the same nvme_path keeps them until it closes too); no training after it."""
        for swap in set(self.swaps.values()):
            swap.close()
        if self.watchdog is not None:
            self.watchdog.stop()

    # --- the hand-written loop: `ZeroEngine` only -----------------------------------------
    def __call__(self, *args, **kwargs):
        raise self._train_batch_only("engine(batch)")

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> None:
        raise self._train_batch_only("engine.backward(loss)")

    def step(self) -> bool:
        raise self._train_batch_only("engine.step()")

    def zero_grad(self) -> None:
        raise self._train_batch_only("engine.zero_grad()")

    def gathered_parameters(self, params=None, modifier_rank: int | None = None):
        raise NotImplementedError(
            f"hf_zero: {type(self).__name__} keeps each stage's parameters whole on its own "
            "ranks; there is nothing to gather. Call engine.full_state_dict() for the whole "
            "model on rank 0"
        )

    def save_pretrained(self, directory: str | Path, is_main_process: bool = True, **kwargs):
        raise NotImplementedError(
            f"hf_zero: {type(self).__name__} does not stream save_pretrained (each stage holds "
            "its own layers); write model.save_pretrained(dir, state_dict="
            "engine.saved_state_dict()) on rank 0, or use the Trainer's save_model"
        )

    def _train_batch_only(self, call: str) -> NotImplementedError:
        return NotImplementedError(
            f"hf_zero: {type(self).__name__} has no {call}: it runs forward, backward and the "
            "optimizer step together. Call engine.train_batch(batch) (engine.eval_batch(batch) "
            "for the loss alone)"
        )


def split_batch(batch: Batch, pieces: int, who: str) -> list[dict[str, torch.Tensor]]:
    """``batch`` cut along its first dimension into ``pieces`` equal micro-batches."""
    sizes = {t.shape[0] for t in batch.values() if torch.is_tensor(t) and t.dim() > 0}
    if len(sizes) != 1:
        raise ValueError(f"{who}: the batch's tensors differ in their first dimension: {sizes}")
    (size,) = sizes
    if size % pieces:
        raise ValueError(
            f"{who}: a batch of {size} samples does not split into {pieces} micro-batches"
        )
    step = size // pieces
    return [
        {k: v[i * step : (i + 1) * step] if torch.is_tensor(v) else v for k, v in batch.items()}
        for i in range(pieces)
    ]


def loss_of(output: Any, who: str) -> torch.Tensor:
    """The loss a model's forward returned (a tensor, a ``ModelOutput`` or a dict with one)."""
    if torch.is_tensor(output):
        return output
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if loss is None:
        raise ValueError(
            f"{who}: the model returned no loss; give the batch 'labels' (a Hugging Face model "
            "then computes the loss), or run your own loop with engine(batch), "
            "engine.backward(loss) and engine.step()"
        )
    return loss
