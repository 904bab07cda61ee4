"""PEFT helpers: export a LoRA model trained under hf_zero as one merged model for inference.

`merged_state_dict` gathers the whole PEFT model once (`ZeroEngine.full_state_dict`: under
MixZ++ the frozen base comes back dequantized from its INT8 shards) and folds every LoRA adapter
into its base weight on CPU: ``W + scaling * B @ A``. The result is keyed like the base model,
so ``base_model.save_pretrained(dir, state_dict=merged)`` writes a plain Hugging Face model that
``AutoModelForCausalLM.from_pretrained`` loads without PEFT.
"""

from __future__ import annotations

import torch

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
        merged[f"{name}.weight"] = (weight.float() + delta).to(weight.dtype)
        if f"{name}.base_layer.bias" in merged:
            merged[f"{name}.bias"] = merged.pop(f"{name}.base_layer.bias")
    return {k.removeprefix(PEFT_PREFIX): v for k, v in merged.items()}


def save_merged(engine, model, output_dir: str, tokenizer=None, adapter: str = "default") -> None:
    """Write the merged model to ``output_dir`` on rank 0 (collective)."""
    merged = merged_state_dict(engine, model, adapter)
    if merged:
        model.get_base_model().save_pretrained(output_dir, state_dict=merged)
        if tokenizer is not None:
            tokenizer.save_pretrained(output_dir)
