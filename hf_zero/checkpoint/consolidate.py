"""``hf-zero consolidate``: a sharded engine checkpoint -> Hugging Face safetensors, streamed.

Each parameter is assembled from the per-rank shard files by `checkpoint_read.ShardReader` (plain
positioned reads, no memory map, so pages of the inputs never pile up in this process) and
appended to the output
file, whose header is computed up front. Peak memory is one parameter plus small buffers,
whatever the model size. Outputs above ``max_shard_bytes`` are split into several files with a
``model.safetensors.index.json``, as ``save_pretrained`` does.

The checkpoint holds the *trainable* parameters (fp32 master weights). For a full fine-tune that
is the whole model; for a LoRA run ``--adapter-only`` writes ``adapter_model.safetensors`` with
PEFT's key names (frozen base weights come from the base model). A PEFT checkpoint is refused as
a full model: its names (``base_model.model...``, ``lora_A``, ``base_layer``) are not a model's.

The input is an engine checkpoint directory or a Trainer ``checkpoint-N`` directory (its engine
checkpoint is the ``zero/`` subdirectory). From a Trainer checkpoint the files that make the
output loadable are copied too: ``config.json`` (``from_pretrained``) or ``adapter_config.json``
and ``hf_zero_training.json`` (``PeftModel.from_pretrained``, ``hf_zero.load_for_inference``),
plus the tokenizer; a full model's frozen parameters, which the engine checkpoint does not hold,
are taken from the model the Trainer saved in the same directory.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import warnings
from pathlib import Path

import torch

from hf_zero.checkpoint.format import META, ShardReader, read_meta
from hf_zero.checkpoint.pipeline_format import consolidate_pipeline, is_pipeline_checkpoint
from hf_zero.storage.safetensors import indexed_files, write_streamed

TRAINER_ZERO_DIR = (
    "zero"  # = hf_zero.integrations.trainer_checkpoints.ZERO_DIR (not imported: slow)
)
PEFT_MARKERS = ("base_model.model.", ".lora_", ".base_layer.", "modules_to_save")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
MODEL_FILES = ("config.json", "generation_config.json")
ADAPTER_FILES = ("adapter_config.json", "hf_zero_training.json")


def resolve_checkpoint(path: str | Path) -> tuple[Path, Path | None]:
    """``(engine checkpoint, directory of the saved model or None)`` for an engine checkpoint,
    a Trainer ``checkpoint-N`` directory, or the ``zero/`` inside one."""
    path = Path(path)
    if not (path / META).is_file() and (path / TRAINER_ZERO_DIR / META).is_file():
        return path / TRAINER_ZERO_DIR, path
    if path.name == TRAINER_ZERO_DIR and any(
        (path.parent / f).is_file() for f in (*MODEL_FILES, *ADAPTER_FILES)
    ):
        return path, path.parent
    return path, None


def consolidate(
    checkpoint: str | Path,
    output: str | Path,
    dtype: torch.dtype = torch.float32,
    adapter_only: bool = False,
    max_shard_bytes: int = 5 * 2**30,
) -> list[Path]:
    """Write the checkpoint's parameters as Hugging Face safetensors; returns the files written
    (with the config and tokenizer files copied from a Trainer checkpoint)."""
    given = Path(checkpoint)
    for pipeline_dir in (given, given / TRAINER_ZERO_DIR):  # an engine's or a Trainer's
        if is_pipeline_checkpoint(pipeline_dir):
            if adapter_only:
                raise ValueError("hf_zero consolidate: --adapter-only: pipeline checkpoints "
                                 "hold full models (pipeline stages train every parameter)")  # fmt: skip
            files = consolidate_pipeline(pipeline_dir, output, dtype)
            saved_dir = given if pipeline_dir != given else None
            return files + _copy_configs(saved_dir, Path(output), False)
    checkpoint, saved_dir = resolve_checkpoint(checkpoint)
    output = Path(output)
    reader = ShardReader(checkpoint, read_meta(checkpoint))
    meta = reader.meta
    if meta.get("tp_size", 1) > 1:
        raise NotImplementedError(
            f"hf_zero consolidate: '{checkpoint}' holds tensor-parallel slices (tp_size = "
            f"{meta['tp_size']}); joining them offline is not implemented. Save full weights "
            "from the run instead (save_model / save_pretrained gathers across TP ranks)"
        )

    params = [slot for group in meta["groups"] for slot in group["params"]]
    if adapter_only:
        params = [s for s in params if ".lora_" in s["name"]]
        if not params:
            raise ValueError(f"hf_zero: --adapter-only: no LoRA parameters in {checkpoint}")
    else:
        peft = [s["name"] for s in params if any(m in s["name"] for m in PEFT_MARKERS)]
        if peft:
            raise ValueError(
                f"hf_zero consolidate: '{checkpoint}' holds a PEFT model's parameters (e.g. "
                f"'{peft[0]}'); as a full model they would keep PEFT's internal names, which "
                "from_pretrained does not load. Use --adapter-only (adapter_model.safetensors "
                "for PeftModel.from_pretrained), or merge the adapter into the base "
                "(hf_zero.save_merged during the run, or merge_and_unload() after loading it)"
            )
    entries = [(_output_name(s["name"], adapter_only), dtype, tuple(s["shape"])) for s in params]
    extra = {} if adapter_only or saved_dir is None else _frozen_from_saved(saved_dir, params)
    entries += [(name, dtype, shape) for name, (_, shape) in extra.items()]
    itemsize = torch.empty(0, dtype=dtype).element_size()
    files: list[list[int]] = [[]]
    size = 0
    numels = [s["numel"] for s in params] + [
        torch.Size(shape).numel() for _, shape in extra.values()
    ]
    for i, numel in enumerate(numels):
        nbytes = numel * itemsize
        if files[-1] and size + nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(i)
        size += nbytes
    output.mkdir(parents=True, exist_ok=True)
    stem = "adapter_model" if adapter_only else "model"
    names = (
        [f"{stem}.safetensors"]
        if len(files) == 1
        else [f"{stem}-{k + 1:05d}-of-{len(files):05d}.safetensors" for k in range(len(files))]
    )
    written = []
    weight_map = {}

    def read_one(i: int) -> dict[str, torch.Tensor]:
        """Tensor ``i`` in the output dtype: read only when the writer reaches it."""
        name = entries[i][0]
        if i < len(params):
            slot = params[i]
            values = reader.read(slot["name"], "master", 0, slot["numel"])
            values = values.view(tuple(slot["shape"]))
        else:
            values = _read_saved(saved_dir, extra[name][0], name)
        return {name: values.to(dtype)}

    for file_name, indices in zip(names, files):
        pieces = [
            ({entries[i][0]: entries[i][1:]}, functools.partial(read_one, i)) for i in indices
        ]
        write_streamed(pieces, output / file_name, metadata={"format": "pt"})
        weight_map.update({entries[i][0]: file_name for i in indices})
        written.append(output / file_name)
    if len(files) > 1:
        index = {
            "metadata": {"total_size": sum(p.stat().st_size for p in written)},
            "weight_map": weight_map,
        }
        (output / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return written + _copy_configs(saved_dir, output, adapter_only)


def _frozen_from_saved(saved_dir: Path, params: list[dict]) -> dict[str, tuple[str, tuple]]:
    """Tensors of the model the Trainer saved in ``saved_dir`` that the engine checkpoint lacks
    (frozen parameters): name -> (file, shape). Tied weights are not saved twice, so none."""
    from safetensors import safe_open

    index = saved_dir / "model.safetensors.index.json"
    if index.is_file():
        root = saved_dir.resolve()
        files = sorted({str(p.relative_to(root)) for p in indexed_files(saved_dir, index).values()})
    else:
        files = ["model.safetensors"] if (saved_dir / "model.safetensors").is_file() else []
    have = {s["name"] for s in params}
    extra = {}
    for file_name in files:
        with safe_open(saved_dir / file_name, "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name not in have:
                    extra[name] = (file_name, tuple(f.get_slice(name).get_shape()))
    return extra


def _read_saved(saved_dir: Path, file_name: str, name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(saved_dir / file_name, "pt") as f:
        return f.get_tensor(name)


def _copy_configs(saved_dir: Path | None, output: Path, adapter_only: bool) -> list[Path]:
    """Copy what makes ``output`` loadable from the Trainer checkpoint; warn when missing."""
    needed = ADAPTER_FILES[0] if adapter_only else MODEL_FILES[0]
    copied = []
    if saved_dir is not None:
        for name in (*(ADAPTER_FILES if adapter_only else MODEL_FILES), *TOKENIZER_FILES):
            if (saved_dir / name).is_file():
                shutil.copyfile(saved_dir / name, output / name)
                copied.append(output / name)
    if not (output / needed).is_file():
        warnings.warn(
            f"hf_zero consolidate: no {needed} next to the checkpoint (pass the Trainer's "
            f"checkpoint-N directory, or copy the model's {needed} into {output})",
            stacklevel=3,
        )
    return copied


def _output_name(name: str, adapter_only: bool) -> str:
    # PEFT saves adapter weights without the adapter's name: "...lora_A.default.weight" ->
    # "...lora_A.weight".
    return (
        re.sub(r"\.(lora_[AB]|lora_embedding_[AB])\.[^.]+\.", r".\1.", name)
        if adapter_only
        else name
    )
