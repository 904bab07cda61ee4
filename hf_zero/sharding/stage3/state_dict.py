"""``state_dict()`` and ``load_state_dict()`` on a ZeRO-3 model: whole weights, never empty ones.

Between uses a ZeRO-3 parameter holds no elements (its values live in 1/N shards), so torch's
own ``state_dict()`` would hand out 0-element tensors. `StateDictHooks` puts state-dict and
load-state-dict hooks on every module whose subtree holds engine-managed parameters:

* ``state_dict()`` (and so ``save_pretrained()`` without ``state_dict=``, ``torch.save(model.
  state_dict())``, PEFT's ``get_peft_model_state_dict``): a module's pre-hook gathers the groups
  of its own sharded parameters (exactly: never ZeRO++-quantized; a MixZ++ frozen base comes
  back dequantized), its post-hook replaces their entries with CPU copies, and a unit's groups are
  released when that unit's post-hook runs, so a rank holds at most the root and one unit
  gathered at a time (plus the CPU copies). It works on submodules too
  (``model.model.layers[0].state_dict()``). ``keep_vars=True`` returns the parameters
  themselves, untouched (the engine's own ``full_state_dict`` reads them that way).
* ``load_state_dict()``: the same gather before torch copies the values in; then the new values
  of rank 0 of the data-parallel group are broadcast and written into the shards and the fp32
  master weights (`FlatParamGroup.broadcast_from`, as ``gathered_parameters(modifier_rank=0)``),
  so they survive the next step. ``assign=True`` is refused.
* AutoTP: ``state_dict()`` also all-gathers each tensor-parallel slice over the TP group (whole
  weights, as ``full_state_dict``); ``load_state_dict()`` would have to split them and is
  refused with what to do instead.

Both are **collective**, like DeepSpeed's ``GatheredParameters`` and
``zero_gather_16bit_weights_on_model_save``: every data-parallel rank must make the same call at
the same time (``model.save_pretrained(dir, is_main_process=rank == 0)`` on every rank, not
inside ``if rank == 0:``). A monitored barrier on the CPU control group starts each call, so a
call made by only some ranks raises a clear error after `SYNC_TIMEOUT` instead of hanging.
Every rank gets the whole weights, in CPU memory; for a large model
``engine.full_state_dict()`` (rank 0 only) is lighter.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from hf_zero.comm import Collectives
from hf_zero.comm.topology import Group
from hf_zero.sharding.flat_group import FlatParamGroup
from hf_zero.sharding.stage3.coordinator import gather_groups
from hf_zero.sharding.stage3.units import Unit
from hf_zero.sharding.tp import TensorParallel

SYNC_TIMEOUT = datetime.timedelta(minutes=5)
"""How long the first rank to call ``state_dict()`` waits for the others before it raises."""

_INSTEAD = (
    "Call it on every rank together, e.g. model.save_pretrained(dir, is_main_process=rank == 0) "
    "on all ranks rather than inside `if rank == 0:`. engine.full_state_dict() (also collective) "
    "keeps the whole weights on rank 0 only; hf_zero.gathered_parameters(params) gathers chosen "
    "parameters (with modifier_rank=0 to write them)."
)
_GONE = (
    "Save or load before the process group is destroyed (before accelerator.end_training() or "
    "dist.destroy_process_group()): model.state_dict() on every rank, engine.full_state_dict(), "
    "or hf_zero.gathered_parameters(params, modifier_rank=0) to write weights."
)


def mark_whole_shapes(groups: list[FlatParamGroup]) -> None:
    """Give every sharded parameter DeepSpeed's ``ds_numel``/``ds_shape``: its whole size.

    transformers' parameter count under ZeRO-3 and PEFT (``print_trainable_parameters``,
    adapter shapes on an already sharded model) read these when ``numel()`` is 0.
    """
    for group in groups:
        if group.stage == 3:
            shapes = group.packed.shapes if group.packed is not None else None
            for i, (slot, p) in enumerate(zip(group.layout.slots, group.params)):
                p.ds_shape = torch.Size(shapes[i]) if shapes else slot.shape
                p.ds_numel = p.ds_shape.numel()


class StateDictHooks:
    """State-dict and load-state-dict hooks that gather ZeRO-3 parameters (module docstring)."""

    def __init__(
        self,
        root: torch.nn.Module,
        units: list[Unit],
        control: Group,
        tp: TensorParallel | None = None,
        comm: Collectives | None = None,
    ) -> None:
        self.control = control
        self.comm = (comm or Collectives()).for_purpose("control")  # the start-of-call barrier
        self.tp = tp
        self.unit_groups = {id(u.module): list(u.groups) for u in units if u.groups}
        self.direct: dict[int, list[tuple[str, FlatParamGroup]]] = {}
        self.parents: dict[int, set[int]] = {}
        hooked: dict[int, torch.nn.Module] = {}

        def visit(module: torch.nn.Module) -> bool:
            if id(module) in self.direct:
                return id(module) in hooked
            own = [
                (name, group)
                for name, p in module._parameters.items()
                if p is not None and (group := getattr(p, "_hf_zero_group", None)) is not None
            ]
            self.direct[id(module)] = own
            has = bool(own)
            for child in module.children():
                has = visit(child) or has
            if has:
                hooked[id(module)] = module
            return has

        visit(root)
        for module in hooked.values():
            for child in module.children():
                self.parents.setdefault(id(child), set()).add(id(module))
        self._stack: list[tuple[int, str]] = []  # (module, "save" | "vars" | "load") in progress
        self._mine: list[FlatParamGroup] = []  # gathered by the call in progress
        self._touched: list[FlatParamGroup] = []  # load: groups whose parameters were written
        self._copies: dict[int, torch.Tensor] = {}  # save: one CPU copy per parameter (tied too)
        self._handles = []
        for module in hooked.values():
            # Plain functions: torch marks post-hooks with an attribute, which a bound method
            # cannot take.
            self._handles += [
                module.register_state_dict_pre_hook(lambda *a: self._pre_save(*a)),
                module.register_state_dict_post_hook(lambda *a: self._post_save(*a)),
                module.register_load_state_dict_pre_hook(lambda *a: self._pre_load(*a)),
                module.register_load_state_dict_post_hook(lambda *a: self._post_load(*a)),
            ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # --- state_dict --------------------------------------------------------------------------
    def _pre_save(self, module: torch.nn.Module, prefix: str, keep_vars: bool) -> None:
        self._enter(module, "vars" if keep_vars else "save")
        if not keep_vars:
            self._gather([g for _, g in self.direct[id(module)] if g.stage == 3])

    def _post_save(self, module: torch.nn.Module, state: dict, prefix: str, metadata) -> None:
        kind = self._leave(module)
        if kind == "save":
            for name, group in self.direct[id(module)]:
                key = prefix + name
                p = module._parameters[name]
                tp_shard = self.tp.shard_of(p) if self.tp is not None else None
                if (group.stage != 3 and tp_shard is None) or key not in state:
                    continue
                copy = self._copies.get(id(p))
                if copy is None:
                    value = state[key].detach()
                    if group.stage == 3 and value.numel() != p.ds_numel:  # never empty weights
                        raise RuntimeError(
                            f"hf_zero ZeRO-3: '{key}' has {value.numel()} of its {p.ds_numel} "
                            f"elements in state_dict(). {_INSTEAD}"
                        )
                    if tp_shard is not None:  # collective over the TP group
                        value = self.tp.gather_full(value, tp_shard)
                    copy = self._copies[id(p)] = value.to("cpu", copy=True)
                state[key] = copy
                if group.packed is not None:  # its quantization state views the gathered bytes
                    for extra in [k for k in state if k.startswith(key + ".")]:
                        state[extra] = state[extra].detach().to("cpu", copy=True)
            self._release_unit(module)
        if kind is not None and not self._stack:
            self._finish()

    # --- load_state_dict ---------------------------------------------------------------------
    def _pre_load(self, module, state, prefix, metadata, strict, missing, unexpected, errors):
        if metadata.get("assign_to_params_buffers", False):
            raise ValueError(
                "hf_zero ZeRO-3: load_state_dict(assign=True) would replace parameters that the "
                "engine shards; load with assign=False (the default), which writes into the shards"
            )
        outermost = not self._stack or self._stack[-1][0] not in self.parents.get(id(module), ())
        if (
            outermost
            and self.tp is not None
            and any(self.tp.shard_of(p) is not None for p in module.parameters())
        ):
            raise NotImplementedError(
                f"hf_zero AutoTP: load_state_dict() into {type(module).__name__} would have to "
                "split whole weights into this rank's tensor-parallel slices; load the weights "
                "into the model before hf_zero.initialize() (or use load_checkpoint)"
            )
        self._enter(module, "load")
        groups = [g for _, g in self.direct[id(module)]]
        self._gather([g for g in groups if g.stage == 3])
        self._touched += [g for g in dict.fromkeys(groups) if g not in self._touched]

    def _post_load(self, module: torch.nn.Module, incompatible_keys) -> None:
        kind = self._leave(module)
        if kind != "load":
            return
        unit = self.unit_groups.get(id(module), [])
        if self._stack and unit:
            done = [g for g in self._touched if g in unit]
            self._publish(done)
            self._touched = [g for g in self._touched if g not in done]
            self._release_unit(module)
        if not self._stack:
            self._publish(self._touched)
            self._finish()

    def _publish(self, groups: list[FlatParamGroup]) -> None:
        """Rank 0's loaded values into every rank's shards and fp32 master weights."""
        with torch.no_grad():
            for group in groups:
                group.broadcast_from(group.shard_group.ranks[0])

    # --- sessions: one outermost call and the calls torch makes on its submodules ------------
    def _enter(self, module: torch.nn.Module, kind: str) -> None:
        if self._stack and self._stack[-1][0] not in self.parents.get(id(module), ()):
            self._finish()  # an earlier call raised half-way: forget it
        if not self._stack and kind != "vars":
            self._sync(kind)
        self._stack.append((id(module), kind))

    def _leave(self, module: torch.nn.Module) -> str | None:
        """The kind of call this module's hooks are finishing (None: not one we started)."""
        if not self._stack or self._stack[-1][0] != id(module):
            return None
        return self._stack.pop()[1]

    def _gather(self, groups: list[FlatParamGroup]) -> None:
        todo = [g for g in dict.fromkeys(groups) if g.flat_param is None]
        gather_groups(todo, exact=True)
        self._mine += todo

    def _release_unit(self, module: torch.nn.Module) -> None:
        """A unit is complete: release what this call gathered of it (unless it is outermost)."""
        unit = self.unit_groups.get(id(module))
        if unit and self._stack:
            for group in [g for g in self._mine if g in unit]:
                group.release()
            self._mine = [g for g in self._mine if g not in unit]

    def _finish(self) -> None:
        for group in self._mine:
            group.release()
        self._stack.clear()
        self._mine, self._touched, self._copies = [], [], {}

    def _sync(self, kind: str) -> None:
        """Every rank must be here: the gathers that follow are collectives."""
        if self.control.size == 1:
            return
        what = "state_dict()" if kind == "save" else "load_state_dict()"
        if not dist.is_initialized():
            raise RuntimeError(
                f"hf_zero ZeRO-3: {what} must gather sharded parameters, but the process group "
                f"is gone. {_GONE}"
            )
        try:
            self.comm.barrier(self.control, monitored_timeout=SYNC_TIMEOUT)
        except Exception as error:  # gloo reports missing ranks as RuntimeError/DistBackendError
            raise RuntimeError(
                f"hf_zero ZeRO-3: {what} gathers sharded parameters with collectives, so every "
                f"rank must call it at the same time; not every rank did within "
                f"{SYNC_TIMEOUT.total_seconds():.0f} s ({error}). {_INSTEAD}"
            ) from error
