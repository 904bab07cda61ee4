"""bitsandbytes quantized parameters (QLoRA bases) as bytes, never as numbers.

A ``Params4bit`` holds packed 4-bit codes in whatever ``quant_storage`` dtype the model was
loaded with (``uint8`` by default, ``bfloat16`` for ZeRO-3/FSDP recipes), and an ``Int8Params``
holds LLM.int8 codes; the scales that make them weights (``quant_state.absmax``, ``SCB``) sit
beside them. None of their elements is a value: a float cast rewrites codes whose bit patterns
read as NaN, an fp32 buffer changes their sizes, and a quantizer treats them as weights. So the
engine moves them as raw bytes on every path (flat buffers, gathers, tiers), never casts,
reduces, clips or NaN-checks them, and leaves their quantization state with the parameter.

Nothing here imports bitsandbytes: a model without it never pays for it, and the checks are on
the parameter classes bitsandbytes defines.
"""

from __future__ import annotations

import torch

PACKED_CLASSES = ("Params4bit", "Int8Params")


def is_packed(param: torch.Tensor) -> bool:
    """True for a bitsandbytes quantized parameter (``Params4bit``, ``Int8Params``)."""
    cls = type(param)
    return cls.__name__ in PACKED_CLASSES and cls.__module__.startswith("bitsandbytes")


def is_int8_linear(module: torch.nn.Module) -> bool:
    """True for bitsandbytes' own ``Linear8bitLt`` (not PEFT's wrapper of the same name)."""
    cls = type(module)
    weight = getattr(module, "weight", None)
    return (
        cls.__module__.startswith("bitsandbytes")
        and is_packed(weight)
        and type(weight).__name__ == "Int8Params"
    )


def quant_state_tensors(param: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors that turn a packed parameter's codes into weights, by name (for the
    start-up broadcast and `memory_report`): absmax and code (with the nested statistics'
    own) of a ``Params4bit``, the row scales ``SCB`` of an ``Int8Params``."""
    out: dict[str, torch.Tensor] = {}
    state = getattr(param, "quant_state", None)
    if state is not None:
        for key in ("absmax", "code", "offset"):
            value = getattr(state, key, None)
            if torch.is_tensor(value):
                out[key] = value
        nested = getattr(state, "state2", None)
        if nested is not None:
            for key in ("absmax", "code"):
                value = getattr(nested, key, None)
                if torch.is_tensor(value):
                    out[f"state2.{key}"] = value
    scb = getattr(param, "SCB", None)
    if torch.is_tensor(scb):
        out["SCB"] = scb
    module = getattr(param, "_hf_zero_int8_module", None)
    if module is not None and torch.is_tensor(getattr(module.state, "SCB", None)):
        out.setdefault("SCB", module.state.SCB)
    return out


def packed_bytes(param: torch.Tensor) -> int:
    """Bytes of a packed parameter's codes and quantization state on this rank."""
    return param.numel() * param.element_size() + sum(
        t.numel() * t.element_size() for t in quant_state_tensors(param).values()
    )


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D ``uint8`` view of ``tensor``'s bytes (no copy, no cast)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


SLOT_ALIGN = 16
"""Bytes each part of a slot is padded to, so every view of the buffer starts aligned."""


def _padded(nbytes: int) -> int:
    return -(-nbytes // SLOT_ALIGN) * SLOT_ALIGN


def _nbytes(dtype: torch.dtype, shape) -> int:
    return torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()


class PackedViews:
    """How a group of packed parameters lies in a ``uint8`` flat buffer.

    Each parameter's slot holds its codes (``numel * element_size`` bytes) and, for a 4-bit
    weight, its ``quant_state.absmax`` right after them (one scale per 64-value block: 1/16 of
    NF4's bytes), so the scales are sharded and gathered with the codes they scale. A gathered
    buffer is viewed back in each tensor's own dtype and shape; between gathers both are empty.
    The rest of the quantization state (code book, nested statistics, shape) is small and stays
    whole on every rank; an ``Int8Params``' row scales (``SCB``) too.
    """

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.dtypes = [p.dtype for p in params]
        self.shapes = [tuple(p.shape) for p in params]
        scales = [quant_state_tensors(p).get("absmax") for p in params]
        self.scale_specs = [None if a is None else (a.dtype, tuple(a.shape)) for a in scales]

    def byte_shapes(self) -> list[tuple[int]]:
        """The layout's shapes: one flat run of bytes per parameter (codes, then scales)."""
        return [(self._codes_bytes(i) + self._scale_bytes(i),) for i in range(len(self.dtypes))]

    def fill(self, full: torch.Tensor, slots, params: list[torch.Tensor]) -> None:
        """Copy each parameter's bytes (and its scales') into its slot of ``full``."""
        for i, (slot, p) in enumerate(zip(slots, params)):
            codes = as_bytes(p)
            full[slot.offset : slot.offset + codes.numel()].copy_(codes)
            if self.scale_specs[i] is not None:
                scales = as_bytes(p.quant_state.absmax)
                at = slot.offset + self._codes_bytes(i)
                full[at : at + scales.numel()].copy_(scales)

    def point(self, flat: torch.Tensor, slots, params: list[torch.Tensor]) -> None:
        """Make each parameter (and its scales) a view of its bytes in the gathered ``flat``."""
        for i, (slot, p) in enumerate(zip(slots, params)):
            dtype, shape = self.dtypes[i], self.shapes[i]
            p.data = flat[slot.offset : slot.offset + _nbytes(dtype, shape)].view(dtype).view(shape)
            spec = self.scale_specs[i]
            if spec is not None:
                at = slot.offset + self._codes_bytes(i)
                scales = flat[at : at + _nbytes(*spec)]
                p.quant_state.absmax = scales.view(spec[0]).view(spec[1])
            _bind_int8_state(p)

    def release(self, params: list[torch.Tensor], device: torch.device) -> None:
        """Leave each parameter and its scales empty (their bytes live in the shards)."""
        for i, p in enumerate(params):
            p.data = torch.empty((0, *self.shapes[i][1:]), dtype=self.dtypes[i], device=device)
            spec = self.scale_specs[i]
            if spec is not None:
                p.quant_state.absmax = torch.empty(0, dtype=spec[0], device=device)
            _bind_int8_state(p)

    def _codes_bytes(self, i: int) -> int:
        return _padded(_nbytes(self.dtypes[i], self.shapes[i]))

    def _scale_bytes(self, i: int) -> int:
        spec = self.scale_specs[i]
        return 0 if spec is None else _padded(_nbytes(*spec))


def prepare_int8_module(module: torch.nn.Module) -> None:
    """Let a sharded ``Linear8bitLt`` compute from whatever its weight points at.

    bitsandbytes keeps a second reference to the whole INT8 matrix (``weight.CB``, then
    ``module.state.CB``) and computes from that: under stage 3 it would keep every rank holding
    the whole matrix, and go on computing from stale bytes. The engine drops it and points
    ``state.CB`` at the weight's current data at every gather and release (an empty matrix
    between gathers, so a use while released fails loudly instead of re-quantizing codes).
    """
    weight = module.weight
    if weight.SCB is not None:  # not yet moved into module.state by a first forward
        module.state.SCB = weight.SCB
        weight.SCB = None
    weight.CB = None
    module.state.CB = weight.data
    weight._hf_zero_int8_module = module


def _bind_int8_state(param: torch.Tensor) -> None:
    module = getattr(param, "_hf_zero_int8_module", None)
    if module is not None:
        module.state.CB = param.data


def disable_cpu_repacking(model: torch.nn.Module) -> int:
    """Switch off bitsandbytes' in-place CPU inference repacking on every ``Linear4bit``.

    On CPUs with AVX512-BF16, a ``Linear4bit`` forward in eval mode without gradients rewrites
    ``weight.data`` into another packed layout and rounds ``quant_state.absmax`` to bf16, in
    place; gradients through the base computed afterwards are wrong, and a sharded weight would
    be rewritten in a gathered buffer the shards never see. Returns how many modules were
    switched off. A weight that was repacked already cannot be restored (its scales were
    rounded): ``ValueError`` says to load the model again.
    """
    count = 0
    for name, module in model.named_modules():
        if not hasattr(module, "support_avx512bf16_for_cpu"):
            continue
        module.support_avx512bf16_for_cpu = False
        state = getattr(module.weight, "quant_state", None)
        if getattr(state, "packing_format_for_cpu", False):
            raise ValueError(
                f"hf_zero: '{name}' was repacked by bitsandbytes' CPU inference kernel (an "
                "eval-mode forward without gradients ran before hf_zero took the model), which "
                "rounds its quantization scales to bf16 in place and cannot be undone; load the "
                "model again and hand it to hf_zero (or the Trainer) before evaluating it"
            )
        count += 1
    return count


def check_packed(model: torch.nn.Module, optimizer: torch.optim.Optimizer, config) -> None:
    """Refuse, before any process-group work, what cannot run on bitsandbytes parameters."""
    packed = [(n, p) for n, p in model.named_parameters() if is_packed(p)]
    if not packed:
        return
    in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for name, p in packed:
        if p.requires_grad or id(p) in in_optimizer:
            raise ValueError(
                f"hf_zero: '{name}' is a bitsandbytes {type(p).__name__} (packed quantized codes, "
                "not values) and is trainable or in the optimizer; freeze it and train adapters "
                "on it (PEFT LoRA does: get_peft_model(model, LoraConfig(...)))"
            )
    where = {"tp_size": config.tp_size, "pp_size": config.pp_size}
    for key, value in where.items():
        if value > 1:
            raise NotImplementedError(
                f"hf_zero: '{key}' = {value} with a bitsandbytes quantized base "
                f"('{packed[0][0]}'): slicing packed 4-/8-bit codes across ranks is not "
                f"implemented; use '{key}': 1 with ZeRO stages 0-3 (data parallel) for QLoRA"
            )
