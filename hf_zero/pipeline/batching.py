"""Micro-batches a training loop hands over one at a time, joined into one pipeline batch.

The Trainer calls ``training_step`` once per micro-batch (``--gradient_accumulation_steps`` of
them per optimizer step); a pipeline needs them all at once. Each is padded on the right to
the longest: padding tokens get attention mask 0 and label -100, so in a causal model they
change no real token's output and no loss term.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


def join_microbatches(window: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """``input_ids``, ``attention_mask`` and ``labels`` of every micro-batch, padded and
    concatenated along dim 0 (missing masks are all ones; missing labels are the ids)."""
    length = max(b["input_ids"].shape[1] for b in window)
    parts: dict[str, list[torch.Tensor]] = {"input_ids": [], "attention_mask": [], "labels": []}
    for batch in window:
        ids = batch["input_ids"]
        mask = batch.get("attention_mask")
        labels = batch.get("labels")
        mask = torch.ones_like(ids) if mask is None else mask
        labels = ids if labels is None else labels
        pad = length - ids.shape[1]
        parts["input_ids"].append(torch.nn.functional.pad(ids, (0, pad), value=0))
        parts["attention_mask"].append(torch.nn.functional.pad(mask, (0, pad), value=0))
        parts["labels"].append(torch.nn.functional.pad(labels, (0, pad), value=IGNORE_INDEX))
    sizes = {b["input_ids"].shape[0] for b in window}
    if len(sizes) > 1:
        raise ValueError(
            f"hf_zero pipeline: the micro-batches of one step have different sizes {sorted(sizes)}"
            "; every micro-batch must hold the same number of samples (the Trainer's "
            "dataloader_drop_last=True, which hf_zero sets when pp_size > 1)"
        )
    return {key: torch.cat(tensors) for key, tensors in parts.items()}
