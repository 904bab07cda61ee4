"""PEFT helpers: export a LoRA model trained under hf_zero as one merged model for inference.

`merged_state_dict` gathers the whole PEFT model once (`ZeroEngine.full_state_dict`: under
MixZ++ the frozen base comes back dequantized from its INT8 shards) and folds every LoRA adapter
into its base weight on CPU: ``W + scaling * B @ A``. The result is keyed like the base model,
so ``base_model.save_pretrained(dir, state_dict=merged)`` writes a plain Hugging Face model that
``AutoModelForCausalLM.from_pretrained`` loads without PEFT.
"""

from __future__ import annotations

import torch

from hf_zero.numerics.packed import is_packed

PEFT_PREFIX = "base_model.model."


def merged_state_dict(engine, model, adapter: str = "default") -> dict[str, torch.Tensor]:
    """The base model's state dict with ``adapter`` merged in (collective; ``{}`` off rank 0).

    Supports LoRA on ``nn.Linear`` (including ``fan_in_fan_out`` and rsLoRA scaling); other
    adapter types raise ``NotImplementedError`` naming the module.
    """
    from peft.tuners.lora import LoraLayer

    state = engine.full_state_dict()
    if not state:
        return {}
    merged = {k: v for k, v in state.items() if ".lora_" not in k}
    # A bitsandbytes base is exported dequantized, in the dtype of its unquantized weights.
    base_dtype = next((v.dtype for v in merged.values() if v.is_floating_point()), torch.float32)
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer) or adapter not in module.lora_A:
            continue
        if adapter in getattr(module, "lora_magnitude_vector", {}) or not isinstance(
            module.get_base_layer(), torch.nn.Linear
        ):
            raise NotImplementedError(
                f"hf_zero: merging adapter '{adapter}' into {name} "
                f"({type(module.get_base_layer()).__name__}, DoRA or non-Linear) is not "
                "supported; save the adapter and merge with PEFT after loading it"
            )
        a = state.pop(f"{name}.lora_A.{adapter}.weight").float()
        b = state.pop(f"{name}.lora_B.{adapter}.weight").float()
        delta = (b @ a) * module.scaling[adapter]
        if getattr(module, "fan_in_fan_out", False):
            delta = delta.T
        key = f"{name}.base_layer.weight"
        weight = merged.pop(key)
        if is_packed(module.get_base_layer().weight):
            # The quantization state, whole (as gathered): the merged weight is plain values.
            extras = {
                k.removeprefix(f"{name}.base_layer.").removeprefix("weight."): merged.pop(k)
                for k in [k for k in merged if k.startswith(f"{name}.base_layer.")]
                if not k.endswith(".base_layer.bias")
            }
            weight = dequantized(module.get_base_layer(), weight, extras, base_dtype)
        merged[f"{name}.weight"] = (weight.float() + delta).to(weight.dtype)
        if f"{name}.base_layer.bias" in merged:
            merged[f"{name}.bias"] = merged.pop(f"{name}.base_layer.bias")
    return {k.removeprefix(PEFT_PREFIX): v for k, v in merged.items()}


def dequantized(
    layer: torch.nn.Module, codes: torch.Tensor, state: dict, dtype: torch.dtype
) -> torch.Tensor:
    """A bitsandbytes layer's weight as ``dtype`` values, from its gathered codes and the
    quantization state the state dict holds (``state``, keys without the weight's prefix; an
    int8 layer's row scales are ``SCB`` beside the weight): what a merged export holds, since
    LoRA deltas cannot be added to packed codes."""
    import bitsandbytes.functional as F

    if type(layer.weight).__name__ == "Params4bit":
        quant_state = F.QuantState.from_dict(
            {k: v for k, v in state.items() if not k.startswith(("SCB", "weight_format"))},
            device=codes.device,
        )
        return F.dequantize_4bit(codes, quant_state).to(dtype)
    scb = state.get("SCB")
    if scb is None:
        scb = layer.weight.SCB if layer.weight.SCB is not None else layer.state.SCB
    return (codes.float() * (scb.float().unsqueeze(1) / 127.0)).to(dtype)


def save_merged(engine, model, output_dir: str, tokenizer=None, adapter: str = "default") -> None:
    """Write the merged model to ``output_dir`` on rank 0 (collective)."""
    merged = merged_state_dict(engine, model, adapter)
    if merged:
        base = model.get_base_model()
        if any(is_packed(p) for p in base.parameters()):
            _save_dequantized(base, merged, output_dir)
        else:
            base.save_pretrained(output_dir, state_dict=merged)
        if tokenizer is not None:
            tokenizer.save_pretrained(output_dir)


def _save_dequantized(base: torch.nn.Module, merged: dict, output_dir: str) -> None:
    """A bitsandbytes base merged: plain weights and a config without ``quantization_config``.

    transformers' ``save_pretrained`` on a quantized model re-reads its (sharded) state dict and
    keeps the quantization config, so the files are written here instead.
    """
    import json
    import os

    from safetensors.torch import save_file

    os.makedirs(output_dir, exist_ok=True)
    config = base.config.to_dict()
    config.pop("quantization_config", None)
    with open(os.path.join(output_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    tied = getattr(base.config, "tie_word_embeddings", False)
    tensors = {
        k: v.contiguous().clone()
        for k, v in merged.items()
        if not (tied and k == "lm_head.weight")  # tied: from_pretrained re-ties it
    }
    save_file(tensors, os.path.join(output_dir, "model.safetensors"), metadata={"format": "pt"})
