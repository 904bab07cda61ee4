"""Which modules are ZeRO-3 units, and which unit owns each parameter.

A unit is gathered and released as a whole. Hugging Face models name their repeated blocks in
``_no_split_modules`` (decoder layers); each instance of those classes is a unit. A model without
that attribute gets one unit per block of its largest run of repeated blocks: the
``nn.ModuleList`` / ``nn.Sequential`` whose children (two or more) all have the same class,
largest by parameter count. Only a model with no such list falls back to one unit per direct
child that holds parameters (the children of a ``ModuleList``/``ModuleDict`` child, which is never
called itself). The root module is always unit 0: it owns what no deeper unit owns
(embeddings, final norm, head).

`partitioned_init`, the memory estimator and the engine all call `find_units`, so they agree on
the layout.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hf_zero.sharding.flat_group import FlatParamGroup

logger = logging.getLogger(__name__)


def true_numel(param: torch.Tensor) -> int:
    """Elements of a parameter, whole: also for a released ZeRO-3 parameter (``ds_numel``) or a
    `partitioned_init` slice."""
    slot = getattr(param, "_hf_zero_slot", None)
    if slot is not None:
        return slot[1].numel
    piece = param.__dict__.get("_hf_zero_slice")  # a partitioned from_pretrained's slice
    if piece is not None:
        return piece.numel
    numel = getattr(param, "ds_numel", None)
    return numel if numel is not None else param.numel()


def whole_shape(param: torch.Tensor) -> torch.Size:
    """A parameter's shape, whole: also for a released ZeRO-3 parameter or a
    `partitioned_init` slice."""
    slot = getattr(param, "_hf_zero_slot", None)
    if slot is not None:
        return slot[1].shape
    piece = param.__dict__.get("_hf_zero_slice")
    if piece is not None:
        return piece.shape
    shape = getattr(param, "ds_shape", None)
    return torch.Size(shape) if shape is not None else param.shape


def num_parameters(
    model: torch.nn.Module, only_trainable: bool = False, exclude_embeddings: bool = False
) -> int:
    """How many parameters ``model`` has, counting ZeRO-3 and `partitioned_init` parameters
    whole (``p.numel()`` is 0 for a released one). Arguments as transformers'
    ``PreTrainedModel.num_parameters``; the ``Trainer`` under hf_zero reports this count."""
    skip = set()
    if exclude_embeddings:
        skip = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    return sum(
        true_numel(p)
        for p in model.parameters()
        if (p.requires_grad or not only_trainable) and id(p) not in skip
    )


def _numel_of(module: torch.nn.Module) -> int:
    return sum(true_numel(p) for p in dict.fromkeys(module.parameters()))


def repeated_blocks(model: torch.nn.Module) -> tuple[str, list[tuple[str, torch.nn.Module]]] | None:
    """The largest (by parameters) ``nn.ModuleList``/``nn.Sequential`` of two or more children
    of one class, as ``(list name, [(block name, block), ...])``; None if there is none."""
    best, best_numel = None, 0
    for name, module in model.named_modules():
        if not isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
            continue
        children = list(module.named_children())
        if len(children) < 2 or len({type(c) for _, c in children}) != 1:
            continue
        numel = _numel_of(module)
        if numel > best_numel:
            prefix = f"{name}." if name else ""
            best = (name, [(prefix + n, c) for n, c in children])
            best_numel = numel
    return best


def find_units(model: torch.nn.Module, log: bool = False) -> list[tuple[str, torch.nn.Module]]:
    """The root, then the unit modules (see the module docstring), as ``(name, module)``.

    ``log=True`` says in one line (logger ``hf_zero.sharding.stage3.units``, INFO) how they were chosen.
    """
    class_names: set[str] = set()
    for module in model.modules():
        class_names |= set(getattr(module, "_no_split_modules", None) or [])
    root = [("", model)]
    declared = [
        (name, m)
        for name, m in model.named_modules()
        if m is not model and type(m).__name__ in class_names
    ]
    if declared:
        how = f"{_count(declared)} (from _no_split_modules)"
        units = root + declared
    else:
        why = (
            f"no module of _no_split_modules {sorted(class_names)} found"
            if class_names
            else "model has no _no_split_modules"
        )
        found = repeated_blocks(model)
        if found is not None:
            list_name, blocks = found
            how = f"{_count(blocks)} from {list_name or '<root>'} ({why})"
            units = root + blocks
        else:
            children = _children_with_params(model)
            how = (
                f"one per child with parameters, {len(children)}: "
                f"{', '.join(n for n, _ in children) or 'none'} ({why}, and no list of "
                "repeated blocks)"
            )
            units = root + children
    if log:
        logger.info("hf_zero: stage 3 units: %s", how)
    return units


def _children_with_params(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Direct children holding parameters; a ``ModuleList``/``ModuleDict`` (never called
    itself, so its hooks would never run) stands for its own children."""
    found = []
    for name, child in model.named_children():
        if next(child.parameters(), None) is None:
            continue
        if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            found += [(f"{name}.{n}", m) for n, m in _children_with_params(child)]
        else:
            found.append((name, child))
    return found


def _count(modules: list[tuple[str, torch.nn.Module]]) -> str:
    """``12 x GPT2Block`` (or ``2 x A, 1 x B``)."""
    counts: dict[str, int] = {}
    for _, m in modules:
        counts[type(m).__name__] = counts.get(type(m).__name__, 0) + 1
    return ", ".join(f"{n} x {cls}" for cls, n in counts.items())


def assign_params_to_units(
    model: torch.nn.Module, unit_modules: list[torch.nn.Module]
) -> dict[int, int]:
    """Map ``id(param)`` to the index of the innermost unit owning it.

    A parameter used under two different units (weights tied across layers) goes to the root,
    which stays gathered for the whole forward.
    """
    index_of = {id(m): i for i, m in enumerate(unit_modules)}
    owner: dict[int, int] = {}

    def visit(module: torch.nn.Module, unit: int) -> None:
        unit = index_of.get(id(module), unit)
        for p in module.parameters(recurse=False):
            owner[id(p)] = unit if owner.get(id(p), unit) == unit else 0
        for child in module.children():
            visit(child, unit)

    visit(model, 0)
    return owner


class Unit:
    """A module whose (non-persistent) parameters are gathered and released together."""

    def __init__(self, index: int, name: str, module: torch.nn.Module, is_root: bool) -> None:
        self.index = index
        self.name = name or "<root>"
        self.module = module
        self.is_root = is_root
        self.groups: list[FlatParamGroup] = []
        self.backward_users = 0

    @property
    def numel(self) -> int:
        return sum(g.numel for g in self.groups)

    @property
    def is_gathered(self) -> bool:
        return all(g.flat_param is not None for g in self.groups)
