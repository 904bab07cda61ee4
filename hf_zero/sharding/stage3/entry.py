"""Where a call can enter a stage-3 model below a unit's own module.

A unit is gathered by hooks on its module, and the root unit (embeddings, final norm, head) by
hooks on the model passed to `initialize`. Callers do enter lower down: ``generate()`` of T5 runs
``model.get_encoder()(...)``, a PEFT model's ``generate()`` runs the base model's, a script calls
``model.get_input_embeddings()(ids)``. Every module that holds a unit's parameters, and every
module between it and the unit's module, is such an entry: the coordinator hooks each one so
that a call there gathers the unit first (DeepSpeed fetches per module for the same reason).

Generation runs a different number of forwards on each rank (sequences end at different
lengths), and every stage-3 forward is a collective. transformers keeps ranks stepping together
(``synced_gpus``) for a module marked as sharded by a data-parallel wrapper; `mark_sharded`
marks the model's modules so, as FSDP does.
"""

from __future__ import annotations

import torch


def entry_modules(units: list) -> list[tuple[torch.nn.Module, object]]:
    """``(module, unit)`` for every module through which a call may reach ``unit``'s sharded
    parameters without passing through ``unit.module`` (which has its own hooks)."""
    unit_of = {id(p): u for u in units for g in u.groups for p in g.params}
    unit_modules = {id(u.module) for u in units}
    found: dict[tuple[int, int], tuple[torch.nn.Module, object]] = {}

    def visit(module: torch.nn.Module, path: list[torch.nn.Module]) -> None:
        # A unit's own hooks cover the way in from above it.
        path = [] if id(module) in unit_modules else [*path, module]
        for p in module.parameters(recurse=False):
            unit = unit_of.get(id(p))
            if unit is None:
                continue  # whole on every rank (below the persistence threshold)
            for entry in path:
                found.setdefault((id(entry), unit.index), (entry, unit))
        for child in module.children():
            visit(child, path)

    visit(units[0].module, [])
    return list(found.values())


def mark_sharded(model: torch.nn.Module) -> None:
    """Mark every module as sharded (transformers then generates with ``synced_gpus``)."""
    for module in model.modules():
        module._is_fsdp_managed_module = True
        module._fsdp_use_orig_params = True  # what torch.compile expects of such a module
