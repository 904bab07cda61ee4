"""Checkpoint offload: under activation checkpointing, the inputs each checkpointed layer keeps
for its recomputation (the hidden states between layers) are held in host memory.

Each layer's checkpoint function is wrapped: the layer's forward runs on the device tensors as
before, and only a host copy of its inputs is handed to the checkpoint for the backward's
recomputation, which copies it back first. On CUDA the host copy is pinned and made on a side
stream, so it overlaps the layers that follow; the copy back is waited for only when backward
reaches the layer. On CPU the "host copy" is the tensor itself: the same path runs, exact, with
no memory effect.
"""

from __future__ import annotations

import torch


class _ToHost(torch.autograd.Function):
    """A differentiable copy into host memory (its gradient goes back to the device)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, stream):
        ctx.device = x.device
        if x.device.type != "cuda":
            return x.view_as(x)
        stream.wait_stream(torch.cuda.current_stream(x.device))
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        with torch.cuda.stream(stream):
            host.copy_(x, non_blocking=True)
        x.record_stream(stream)
        host._hf_zero_copied = stream.record_event()  # waited for before the copy back
        return host

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.to(ctx.device, non_blocking=True), None


def _to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    if x.device == device:
        return x
    copied = getattr(x, "_hf_zero_copied", None)
    if copied is not None:
        torch.cuda.current_stream(device).wait_event(copied)
    return x.to(device, non_blocking=True)


class OffloadedCheckpoint:
    """A layer's checkpoint function (``layer._gradient_checkpointing_func``) whose saved inputs
    live in host memory."""

    def __init__(self, checkpoint) -> None:
        self.checkpoint = checkpoint
        self.stream = torch.cuda.Stream() if torch.cuda.is_available() else None

    def __call__(self, function, *args, **kwargs):
        tensors = [a for a in args if torch.is_tensor(a)]
        if not tensors:
            return self.checkpoint(function, *args, **kwargs)
        device = tensors[0].device
        first = list(args)  # the forward itself runs on these, not on the host copies

        def run(*inputs):
            if first:
                inputs = tuple(first)
                first.clear()
            else:
                inputs = tuple(_to_device(a, device) if torch.is_tensor(a) else a for a in inputs)
            return function(*inputs)

        host = [_ToHost.apply(a, self.stream) if torch.is_tensor(a) else a for a in args]
        return self.checkpoint(run, *host, **kwargs)


def offload_checkpoints(model: torch.nn.Module) -> int:
    """Wrap the checkpoint function of every checkpointed layer; the number wrapped. Raises
    ``ValueError`` when activation checkpointing is off (there is nothing to offload)."""
    try:  # transformers >= 4.52 checkpoints these layers; older ones the modules flagged
        from transformers.modeling_layers import GradientCheckpointingLayer as Layer
    except ImportError:
        Layer = torch.nn.Module
    layers = [
        m for m in model.modules()
        if isinstance(m, Layer) and getattr(m, "gradient_checkpointing", False)
        and hasattr(m, "_gradient_checkpointing_func")
    ]  # fmt: skip
    if not layers:
        raise ValueError(
            "zero config: 'offload_checkpoints' = true needs activation checkpointing on "
            "(--gradient_checkpointing, or model.gradient_checkpointing_enable() before hf_zero "
            "wraps the model)"
        )
    for layer in layers:
        if not isinstance(layer._gradient_checkpointing_func, OffloadedCheckpoint):
            layer._gradient_checkpointing_func = OffloadedCheckpoint(
                layer._gradient_checkpointing_func
            )
    return len(layers)
