"""The engines: `initialize()` returns a `ZeroEngine` (ZeRO stages 0-3) or, with ``pp_size`` > 1,
a `PipelineEngine`; both have the `Engine` surface (`surface`). Also here: what an engine saves
(`checkpointing`, `pipeline_checkpointing`, `full_state_dict`, the streamed ``save_pretrained``
of `pretrained_save`) and checks at start (`model_checks`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hf_zero.config.zero_config import ZeroConfig
from hf_zero.engine.surface import Engine
from hf_zero.engine.zero_engine import ZeroEngine

if TYPE_CHECKING:
    from hf_zero.engine.pipeline_engine import PipelineEngine


def initialize(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    config: ZeroConfig | Mapping | str | Path | None = None,
    lr_scheduler=None,
    **overrides,
) -> ZeroEngine | PipelineEngine:
    """Wrap ``model`` and ``optimizer`` for ZeRO training and return the engine: a `ZeroEngine`,
    or a `PipelineEngine` when the config's ``pp_size`` > 1. Both have the `Engine` surface
    (``train_batch``, ``eval_batch``, checkpoints, state dicts, reports); the hand-written loop
    below is `ZeroEngine`'s alone.

    Args:
        model: the model, on any device (it is moved to this rank's device).
        optimizer: an elementwise torch optimizer built on ``model.parameters()`` (or param groups
            of them). ``None`` builds one from the config's DeepSpeed-style ``optimizer`` section.
        config: a `ZeroConfig`, a dict, or a path to an hf_zero YAML/JSON or DeepSpeed JSON.
        lr_scheduler: optional scheduler on ``optimizer``, stepped after each real optimizer step
            (skipped fp16 steps do not advance it). ``None`` builds one from the config's
            DeepSpeed ``scheduler`` section, if any (as DeepSpeed does): ``engine.lr_scheduler``.
        overrides: config fields that win over ``config`` (e.g. ``stage=2``).

    Example::

        engine = hf_zero.initialize(model, torch.optim.AdamW(model.parameters()), stage=2)
        for batch in loader:
            engine.backward(engine(**batch).loss)
            engine.step()
        # or, with either engine: loss = engine.train_batch(batch)
    """
    config = ZeroConfig.load(config, **overrides)
    if config.pp_size > 1:  # a PipelineEngine (train_batch); imported here: it loads in ~1 s
        from hf_zero.engine.pipeline_engine import PipelineEngine

        return PipelineEngine(model, optimizer, config, lr_scheduler)
    return ZeroEngine(model, optimizer, config, lr_scheduler)


__all__ = ["Engine", "ZeroEngine", "initialize"]
