"""Reloading a LoRA adapter as it was trained: the base it was trained on, quantized the same way.

Under MixZ++ (``quantized_nontrainable_weights``) the adapter learned against the *dequantized
INT8* base, not the original one, so ``PeftModel.from_pretrained(original_base, adapter)`` is
not the trained model: on the quick start (150 steps) its logits are 6.0% of their norm away.
Two pieces make the trained model reproducible:

* `save_training_record` (called by ``ZeroTrainer.save_model`` for PEFT models) writes
  ``hf_zero_training.json`` next to the adapter: stage, precision, data-parallel size and, under
  MixZ++, every frozen flat group's parameters in layout order with its shard count, bit width and
  block size (what decides which values share a quantization block), plus a SHA-256 fingerprint
  of (a strided sample of) the base weights the forward computed with.
* `load_for_inference` loads the base, replays exactly that quantization (the engine's own
  `quantize_shard` / `dequantize_rows` on the same shards, so the weights are bit-identical),
  checks the fingerprint, loads the adapter with PEFT and returns the model in eval mode.

How the engine quantizes (``FlatParamGroup``, stage 3): per unit, the frozen parameters above
``param_persistence_threshold`` are laid end to end in registration order, zero-padded to a
multiple of ``8 x N`` (``FlatLayout``), and cut into ``N`` equal shards; each shard is one
quantized row with blocks of ``min(block_size, shard length)`` elements (the last block of a
shard zero-padded), so no block crosses a rank boundary. Every gather dequantizes in fp32 and
casts to the compute dtype. Smaller frozen tensors (norms) are never quantized.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path

import torch

from hf_zero.numerics.packed import disable_cpu_repacking, is_packed

RECORD = "hf_zero_training.json"
FORMAT = 1
PEFT_PREFIX = "base_model.model."
_ADAPTER_MARKERS = ("lora_", "modules_to_save", "trainable_tokens")
SAMPLE = 4096  # values per tensor in the base fingerprint (strided)


def base_name(name: str) -> str | None:
    """The base model's name for a PEFT model's parameter name; None for adapter parameters."""
    if any(marker in name for marker in _ADAPTER_MARKERS):
        return None
    name = name.removeprefix(PEFT_PREFIX)
    return name.replace(".base_layer.", ".").replace(".original_module.", ".")


# --- at save time ------------------------------------------------------------------------------
def training_record(engine, model, state_dict: dict | None = None, samples=None) -> dict:
    """What reproducing this run's forward needs (no collective; ``state_dict`` as gathered by
    ``engine.full_state_dict()``, or the base ``samples`` of `saved_adapter`, adds the base
    fingerprint)."""
    from hf_zero._version import __version__

    config, zpp = engine.config, engine.zeropp
    mixz = bool(config.stage == 3 and zpp.quantized_nontrainable_weights)
    record = {
        "format": FORMAT,
        "hf_zero_version": __version__,
        "zero_stage": config.stage,
        "precision": config.precision,
        "dp_world_size": engine.topology.dp_size,
        "tp_size": engine.topology.tp_size,
        "quantized_nontrainable_weights": mixz,
        "quantized_weights": bool(zpp.quantized_weights),
        "bits": zpp.weight_bits,
        "block_size": zpp.block_size,
        "frozen_format": zpp.frozen_format,
        "param_persistence_threshold": config.param_persistence_threshold,
        "frozen_groups": [
            {
                "num_shards": g.layout.num_shards,
                "params": [
                    {"name": base_name(s.name), "shape": list(s.shape)} for s in g.layout.slots
                ],
            }
            for g in (engine.frozen_groups if mixz else [])
            if g.packed is None  # bitsandbytes codes were used as loaded, not re-quantized
        ],
    }
    quantization = bitsandbytes_config(model)
    if quantization is not None:
        record["bitsandbytes"] = quantization
    if state_dict:
        frozen = {
            n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad
        }
        samples = {base_name(k): sample(v) for k, v in state_dict.items() if k in frozen}
        samples.pop(None, None)
    if samples:
        record["base_sha256"] = digest_samples(samples)
    return record


def save_training_record(
    engine, model, output_dir: str | os.PathLike, state_dict=None, samples=None
) -> None:
    """Write ``hf_zero_training.json`` into ``output_dir``; call it on the rank that saves (with
    the state dict ``engine.full_state_dict()`` gave that rank, or the base samples of
    `saved_adapter`, for the base fingerprint)."""
    record = training_record(engine, model, state_dict, samples)
    groups = record.pop("frozen_groups")
    head = json.dumps(record, indent=1).removesuffix("\n}")
    body = ",\n".join(f"  {json.dumps(g)}" for g in groups)  # one line per group
    listed = f"[\n{body}\n ]" if groups else "[]"
    os.makedirs(output_dir, exist_ok=True)
    Path(output_dir, RECORD).write_text(f'{head},\n "frozen_groups": {listed}\n}}\n')


def fingerprint(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> str:
    """SHA-256 over names, shapes and a strided sample of each tensor's values (at most about
    ``2 * SAMPLE`` of them, in ``dtype``; bitsandbytes codes as they are), in name order: cheap
    for a large base, and any other seed or checkpoint changes the sampled values."""
    return digest_samples({name: sample(t, dtype) for name, t in tensors.items()})


Sample = tuple[str, bytes]


def sample(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> Sample:
    """What `fingerprint` reads of one tensor: its dtype and shape, and its strided sample."""
    cast = None if is_packed(tensor) else dtype
    flat = tensor.detach().reshape(-1)
    flat = flat[:: max(1, flat.numel() // SAMPLE)].to("cpu", cast or flat.dtype).contiguous()
    return f"|{flat.dtype}|{tuple(tensor.shape)}|", flat.view(torch.uint8).numpy().tobytes()


def digest_samples(samples: dict[str, Sample]) -> str:
    """`fingerprint` of tensors sampled one at a time (`sample`), so none need stay whole."""
    digest = hashlib.sha256()
    for name in sorted(samples):
        head, data = samples[name]
        digest.update(f"{name}{head}".encode())
        digest.update(data)
    return digest.hexdigest()


def saved_adapter(engine, model, keep: bool) -> tuple[dict[str, torch.Tensor], dict[str, Sample]]:
    """What an adapter save needs, one group at a time (collective): the trainable tensors as
    saved, and the fingerprint sample of each frozen base weight (the base itself is gathered
    one group at a time and dropped, never whole)."""
    from hf_zero.engine.full_state_dict import saved_export, state_dict_pieces

    frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    state, samples = {}, {}
    for piece in state_dict_pieces(engine, saved_export(engine, keep)):
        for key, value in piece.items():
            if key not in frozen:
                state[key] = value
            elif (name := base_name(key)) is not None:
                samples[name] = sample(value)
    return state, samples


def bitsandbytes_config(model: torch.nn.Module) -> dict | None:
    """How a bitsandbytes base was loaded (its ``quantization_config`` and load dtype), so the
    same codes can be made again at reload; None for any other base."""
    if not any(is_packed(p) for p in model.parameters()):
        return None
    config = getattr(getattr(model, "config", None), "quantization_config", None)
    if config is None:
        return None
    as_dict = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    dtype = getattr(model.config, "dtype", None)
    return {"quantization_config": as_dict, "dtype": str(dtype).removeprefix("torch.")}


# --- at load time ------------------------------------------------------------------------------
def read_record(adapter_dir: str | os.PathLike) -> dict | None:
    path = Path(adapter_dir, RECORD)
    return json.loads(path.read_text()) if path.is_file() else None


@torch.no_grad()
def apply_training_quantization(model: torch.nn.Module, record: dict) -> int:
    """Replace ``model``'s frozen base weights by what the MixZ++ forward computed with (in
    place); returns the number of weights replaced. ``model`` is the plain base or the PEFT
    model."""
    from hf_zero.numerics.quant import dequantize_rows
    from hf_zero.sharding.layout import FlatLayout
    from hf_zero.sharding.tiers.quantized import quantize_frozen

    if record.get("tp_size", 1) > 1:
        raise NotImplementedError(
            "hf_zero: the adapter was trained with tensor parallelism (tp_size = "
            f"{record['tp_size']}); replaying MixZ++ quantization of TP slices is not implemented"
        )
    params: dict[str, torch.nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        key = base_name(name)
        if key is not None:
            params.setdefault(key, p)
    bits, block = record["bits"], record["block_size"]
    kind = record.get("frozen_format", "int")  # records before NF4/FP4 MixZ++: hf_zero's own
    replaced = 0
    for group in record["frozen_groups"]:
        names = [s["name"] for s in group["params"]]
        shapes = [torch.Size(s["shape"]) for s in group["params"]]
        missing = [n for n in names if n not in params]
        wrong = [n for n, s in zip(names, shapes) if n in params and params[n].shape != s]
        if missing or wrong:
            raise ValueError(
                "hf_zero: this base model is not the one the adapter was trained on: "
                f"missing {missing[:3]}, other shapes {wrong[:3]}"
            )
        layout = FlatLayout(names, shapes, group["num_shards"])
        device = params[names[0]].device
        full32 = torch.zeros(layout.padded_numel, dtype=torch.float32, device=device)
        for slot in layout.slots:
            full32[slot.offset : slot.end].copy_(params[slot.name].detach().reshape(-1))
        for k in range(layout.num_shards):
            start, end = layout.shard_range(k)
            q = quantize_frozen(full32[start:end], kind, bits, block)
            full32[start:end] = dequantize_rows(q).reshape(-1)
        for slot in layout.slots:
            params[slot.name].copy_(full32[slot.offset : slot.end].view(slot.shape))
            replaced += 1
    return replaced


def _training_dtype(record: dict | None) -> torch.dtype | None:
    from hf_zero.numerics.precision import DTYPES

    return DTYPES.get(record.get("precision")) if record else None


def _resolve_base(base, adapter_dir: Path, config: dict, record: dict | None) -> torch.nn.Module:
    if isinstance(base, torch.nn.Module):
        return base
    from transformers import AutoModelForCausalLM

    if base is None:
        base = config.get("base_model_name_or_path")
        if not base:
            raise ValueError(
                f"hf_zero: {adapter_dir / 'adapter_config.json'} names no base model "
                "(base_model_name_or_path is null); pass the base model (or its path) as `base`"
            )
        candidates = [Path(base), adapter_dir / "base_model", adapter_dir.parent / "base_model"]
        if Path(base).is_absolute() and not Path(base).exists():
            # The output directory was moved: the recipes keep the base next to the adapter.
            base = next((str(c) for c in candidates if (c / "config.json").is_file()), base)
    quantized = (record or {}).get("bitsandbytes")
    if quantized is None:
        return AutoModelForCausalLM.from_pretrained(base)
    from transformers import BitsAndBytesConfig

    # The same BitsAndBytesConfig and load dtype as training: the same codes.
    return AutoModelForCausalLM.from_pretrained(
        base,
        quantization_config=BitsAndBytesConfig.from_dict(quantized["quantization_config"]),
        dtype=getattr(torch, quantized["dtype"]),
    )


def load_for_inference(
    base: torch.nn.Module | str | os.PathLike | None,
    adapter_dir: str | os.PathLike,
    quantized: bool | str = "auto",
    dtype: torch.dtype | str | None = "auto",
    verify: bool = True,
) -> torch.nn.Module:
    """The PEFT model as it was trained, in eval mode.

    ``base``: a model (modified in place), a Hub id or local path, or None for the adapter's
    ``base_model_name_or_path``. ``quantized``: ``"auto"`` replays MixZ++'s INT8/INT4
    quantize-dequantize of the frozen base when ``hf_zero_training.json`` says it was on;
    ``True`` requires it, ``False`` keeps the base exact (a different model from the trained
    one under MixZ++). ``dtype``: ``"auto"`` casts to the training precision (what 16-bit runs
    need to reproduce their logits), None keeps the base's. ``verify`` checks the base against
    the recorded fingerprint and raises ``ValueError`` on a different base (a wrong seed, a
    different checkpoint) instead of silently giving another model's logits.
    """
    from peft import PeftModel

    adapter_dir = Path(adapter_dir)
    config_path = adapter_dir / "adapter_config.json"
    if not config_path.is_file():
        raise ValueError(f"hf_zero: {adapter_dir} holds no adapter_config.json")
    config = json.loads(config_path.read_text())
    record = read_record(adapter_dir)
    mixz = bool(record and record.get("quantized_nontrainable_weights"))
    if quantized == "auto":
        quantized = mixz
    elif quantized and not mixz:
        raise ValueError(
            f"hf_zero: quantized=True but {adapter_dir / RECORD} "
            + ("records no MixZ++ run" if record else "is missing")
            + ": there is no training quantization to replay"
        )
    model = _resolve_base(base, adapter_dir, config, record)
    if quantized:
        apply_training_quantization(model, record)
        if record.get("quantized_weights"):
            warnings.warn(
                "hf_zero: the run also used qwZ (INT8 weight gathers of every weight), which "
                "is not replayed: logits differ from training by that quantization error",
                stacklevel=2,
            )
    train_dtype = _training_dtype(record)
    if verify and record and record.get("base_sha256") and (quantized or not mixz):
        names = [(base_name(n), p) for n, p in model.named_parameters(remove_duplicate=False)]
        found = fingerprint({n: p for n, p in names if n is not None}, train_dtype)
        if found != record["base_sha256"]:
            raise ValueError(
                f"hf_zero: the base model's weights differ from the ones the adapter in "
                f"{adapter_dir} was trained on (fingerprint mismatch in {RECORD}): load the "
                f"base named in adapter_config.json ({config.get('base_model_name_or_path')}), "
                "or pass verify=False to use this base anyway"
            )
    model = PeftModel.from_pretrained(model, adapter_dir)
    disable_cpu_repacking(model)  # the kernels training used (hf_zero.numerics.packed)
    target = train_dtype if dtype == "auto" else dtype
    if target is not None:
        # Parameters only, as the engine casts them: buffers (rotary inv_freq) stay fp32.
        for p in model.parameters():
            if not is_packed(p):  # bitsandbytes codes, not values
                p.data = p.data.to(target)
    return model.eval()
