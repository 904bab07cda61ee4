"""Closed forms for pipeline schedules: idle (bubble) fraction, micro-batches in flight, and the
largest stage's share of a model. `hf-zero estimate --pp` prints them and
benchmarks/bench_pipeline.py measures against them.

With ``p`` stages, ``m`` micro-batches and equal forward/backward times per stage, every rank
idles ``p - 1`` slots of a step of ``m + p - 1`` (GPipe and 1F1B alike); interleaving ``v``
virtual stages per rank cuts each slot ``v`` times: ``(p - 1) / (v m + p - 1)``. GPipe keeps all
``m`` micro-batches' activations until its backward starts; 1F1B at most ``p - s`` on stage
``s`` (``p`` on the first); interleaved 1F1B starts ``(v - 1) p + 2 (p - 1 - s)`` chunk
forwards (each ``1/v`` of the rank's layers) before its first backward, as
`torch.distributed.pipelining` runs it: on the first stage ``1 + (p - 2) / (v p)`` times 1F1B's.
Micro-batches are counted through a rank's whole share of the layers (an interleaved rank's
``v`` chunks together).
"""

from __future__ import annotations

from hf_zero.pipeline.split import partition_layers

VIRTUAL_STAGES = 2
"""Virtual stages per rank under ``interleaved_1f1b`` (`PipelineEngine`'s choice)."""


def bubble_fraction(schedule: str, pp: int, microbatches: int) -> float:
    """The fraction of a step each rank idles, with equal stage times."""
    v = VIRTUAL_STAGES if schedule == "interleaved_1f1b" else 1
    return (pp - 1) / (v * microbatches + pp - 1)


def in_flight(schedule: str, pp: int, microbatches: int, stage: int = 0) -> float:
    """Micro-batches whose activations pipeline rank ``stage`` holds at once, at most."""
    if schedule == "gpipe" or (schedule == "1f1b" and microbatches < pp):  # the engine: GPipe
        return microbatches
    if schedule == "1f1b":
        return min(microbatches, pp - stage)
    # Interleaved: torch's Interleaved1F1B warm-up, in rounds of micro-batches.
    v = VIRTUAL_STAGES
    per_round = microbatches // max(1, microbatches // pp)
    warmup = (v - 1) * per_round + 2 * (pp - 1 - stage)
    return min(warmup, v * microbatches) / v


def largest_stage_params(layer_params: int, layers: int, embed_params: int, pp: int) -> int:
    """Parameters of the largest stage under ``pp_partition: parameters``, for ``layers`` equal
    decoder layers: the first stage holds the embedding (``embed_params``), the last the head
    of the same size (its own weight, or a tied embedding's copy)."""
    bounds = partition_layers([layer_params] * layers, pp, "parameters", embed_params, embed_params)
    stages = [len(b) * layer_params for b in bounds]
    stages[0] += embed_params
    stages[-1] += embed_params
    return max(stages)
