"""ZeRO stage 3: parameters sharded, gathered just in time by hooks on the user's own modules.

The model is cut into **units**: every instance of a class named in the model's
``_no_split_modules`` (Hugging Face decoder layers; without it, the blocks of the model's largest
list of repeated blocks: `hf_zero.sharding.stage3.units`), plus the root module, which owns whatever no
deeper unit owns (embeddings, final norm, head). A unit's parameters live in one
`FlatParamGroup` per optimizer param group (and one for its frozen parameters); gathering a unit
all-gathers those groups, releasing it drops the full buffers. Parameters smaller than
``param_persistence_threshold`` are not sharded at all: they stay whole on every rank and go
through the stage-2 path (sharded gradients and optimizer state). ``model.state_dict()`` and
``load_state_dict()`` gather what they touch (`hf_zero.sharding.stage3.state_dict`).

Life of a unit in one training step:

* forward pre-hook: gather (or wait for a prefetch), then prefetch the next units of the traced
  execution order; the unit's inputs get a `_PostBackward` marker.
* forward post-hook: release, unless the unit runs again next, it is the root (its
  parameters are used again at the start of backward), or its next use is within
  ``max_reuse_distance`` (`hf_zero.sharding.stage3.reuse`); a gradient hook goes on the outputs.
* backward, when gradients reach the outputs: gather again, prefetch the next units of the
  traced backward order. Activation-checkpoint recomputation runs here, with the unit gathered.
* gradients: the post-accumulate-grad hooks of `GradientReducer` reduce-scatter each group as it
  completes, exactly as in stage 2.
* backward, when gradients reach the inputs: release. What is still gathered when backward ends
  is released by a final callback.

The first step records the order units run in; ranks compare the traces and, if they agree,
later steps prefetch along them. Every unit entry is also checked across ranks with a tiny
all-gather of the unit's index (``check_execution_order``), so a forward that takes different
paths on different ranks raises a clear error instead of deadlocking in mismatched collectives.
A check waits for its answer at once only where this rank is about to issue a collective the
others might not: off the agreed trace, or gathering a unit that is not already on its way. On
the trace its answer is read at the next check (every rank is normally past it by then) or at
the end of backward, so the checks no longer hold every rank in step at every unit; a rank that
leaves the trace still meets the others' checks and raises, and they raise at their next one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch
import torch.utils._pytree as pytree

from hf_zero.comm import Collectives
from hf_zero.comm.topology import Group
from hf_zero.sharding.flat_group import FlatParamGroup
from hf_zero.sharding.stage3.entry import entry_modules, mark_sharded
from hf_zero.sharding.stage3.reuse import ReuseWindow
from hf_zero.sharding.stage3.saved import SavedWeightViews
from hf_zero.sharding.stage3.units import Unit

logger = logging.getLogger(__name__)


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once the unit's backward is done."""

    @staticmethod
    def forward(ctx, hook: Callable[[], None], *tensors: torch.Tensor):
        ctx.hook = hook
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        ctx.hook()
        return (None, *grads)


def _mark(fn: type[_PostBackward], hook: Callable[[], None], obj):
    """Route every tensor in ``obj`` that requires grad through ``fn``; None if there is none."""
    leaves, spec = pytree.tree_flatten(obj)
    where = [i for i, x in enumerate(leaves) if torch.is_tensor(x) and x.requires_grad]
    if not where:
        return None
    marked = fn.apply(hook, *(leaves[i] for i in where))
    for i, t in zip(where, marked):
        leaves[i] = t
    return pytree.tree_unflatten(leaves, spec)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class Zero3Coordinator:
    """Drives gather, prefetch and release of the units from module and autograd hooks."""

    def __init__(
        self,
        units: list[Unit],
        control: Group,
        prefetch_numel: int,
        max_live_numel: int,
        check_execution_order: bool,
        comm: Collectives | None = None,
        read_ahead: int = 0,
        max_reuse_numel: int = 0,
    ) -> None:
        self.units = units
        self.control = control
        self.comm = (comm or Collectives()).for_purpose("control")  # order checks, traces
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        self.check_execution_order = check_execution_order
        self.read_ahead = read_ahead
        """NVMe tier: units beyond the prefetched ones whose shards are read from disk ahead."""
        self.reuse = ReuseWindow(max_reuse_numel, max_live_numel)
        self.forward_trace: list[int] | None = None
        self.backward_trace: list[int] | None = None
        self._recording: tuple[list[int], list[int]] | None = ([], [])
        self._fwd_cursor = 0
        self._bwd_cursor = 0
        self._backward_started = False
        self._prefetched: set[int] = set()
        self._checks: list[tuple[object, torch.Tensor, int]] = []
        """Order checks issued and not yet read: (work, every rank's code, this rank's code)."""
        self.stats = {
            "prefetch_hits": 0,
            "on_demand_gathers": 0,
            "held": 0,
            "checks": 0,
            "checks_waited": 0,
        }
        """How often a unit found its parameters already on the way (prefetched) or not; how
        often one stayed gathered after its forward for its next use (``held``); how many order
        checks ran, and how many of them were waited for at once."""
        self.saved = SavedWeightViews(gather=self._gather_on_demand)
        """Keeps autograd's saved views of gathered weights from pinning released buffers."""
        self._handles = []
        self._entered_below: list[tuple[torch.nn.Module, Unit]] = []
        for unit in units:
            if unit.groups:
                self._install(unit)
        for module, unit in entry_modules(units):
            self._install_entry(module, unit)
        mark_sharded(units[0].module)

    def _install(self, unit: Unit) -> None:
        module = unit.module
        self._handles.append(
            module.register_forward_pre_hook(
                lambda m, args, kwargs, u=unit: self._pre_forward(u, args, kwargs),
                with_kwargs=True,
                prepend=True,
            )
        )
        self._handles.append(
            module.register_forward_hook(
                lambda m, args, output, u=unit: self._post_forward(u, output)
            )
        )

    def _install_entry(self, module: torch.nn.Module, unit: Unit) -> None:
        self._handles.append(
            module.register_forward_pre_hook(
                lambda m, args, kwargs, u=unit: self._enter_below(m, u, args, kwargs),
                with_kwargs=True,
                prepend=True,
            )
        )
        self._handles.append(
            module.register_forward_hook(lambda m, args, out, u=unit: self._leave_below(m, u, out))
        )

    # --- forward -----------------------------------------------------------------------------
    def _enter_below(self, module: torch.nn.Module, unit: Unit, args, kwargs):
        """A module inside ``unit`` is called: a no-op inside the unit's own forward; otherwise
        (the call entered the model below ``unit.module``) the unit is entered here."""
        if unit.is_gathered:
            if any(g.gather_pending for g in unit.groups):
                self._start(unit)  # a prefetch still on its way
                self._gather(unit)
            return None
        self._entered_below.append((module, unit))
        if not unit.is_root:
            return self._pre_forward(unit, args, kwargs)
        # The root stays gathered after such a call (a generate() loop enters here every
        # token), until the next full forward ends, backward ends, or the optimizer steps.
        self._check("enter", unit.index, settled=True)
        self._start(unit)
        self._gather(unit)
        trace = self.forward_trace
        self._fwd_cursor = 1 if trace and trace[0] == unit.index else 0  # prefetch along it
        return None

    def _leave_below(self, module: torch.nn.Module, unit: Unit, output) -> None:
        if not self._entered_below or self._entered_below[-1][0] is not module:
            return None
        self._entered_below.pop()
        if not unit.is_root:
            return self._post_forward(unit, output)
        self._watch_backward(unit, output)
        return None

    def _pre_forward(self, unit: Unit, args, kwargs):
        if unit.is_root and not _in_backward():
            self._fwd_cursor = 0
            if torch.is_grad_enabled():
                self.saved.enter()
        self._check(
            "enter",
            unit.index,
            settled=not self._expected(unit, self.forward_trace, self._fwd_cursor),
        )
        if self._recording is not None and torch.is_grad_enabled() and not _in_backward():
            self._recording[0].append(unit.index)
        self._start(unit)
        if not _in_backward():
            self._prefetch(self.forward_trace, "_fwd_cursor", unit)
        self._gather(unit)
        if torch.is_grad_enabled():
            marked = _mark(_PostBackward, lambda: self._post_backward(unit), (args, kwargs))
            if marked is not None:
                return marked
        return None

    def _post_forward(self, unit: Unit, output):
        needs_backward = torch.is_grad_enabled() and any(
            torch.is_tensor(x) and x.requires_grad for x in pytree.tree_leaves(output)
        )
        if unit.is_root:
            if not _in_backward():
                self.saved.exit()
                trace = self.forward_trace
                self._check(
                    "forward end", -1, settled=trace is None or self._fwd_cursor < len(trace)
                )
            if not needs_backward:
                self.release_all()
        elif (
            not _in_backward()
            and not self._runs_next(unit)
            and not (needs_backward and self._held(unit))
        ):
            unit_release(unit)
        if needs_backward:
            self._watch_backward(unit, output)
        return None

    def _watch_backward(self, unit: Unit, output) -> None:
        """Enter ``unit``'s backward when gradients reach ``output``."""
        # A hook, not a wrapper: outputs stay the tensors the module made, so callers may
        # modify them in place (the Trainer scales the loss with `loss *= ...`).
        outputs = [x for x in pytree.tree_leaves(output) if torch.is_tensor(x) and x.requires_grad]
        if outputs and torch.is_grad_enabled():
            torch.autograd.graph.register_multi_grad_hook(
                outputs, lambda grad: self._pre_backward(unit), mode="any"
            )

    def _runs_next(self, unit: Unit) -> bool:
        trace = self.forward_trace
        return (
            trace is not None
            and self._fwd_cursor < len(trace)
            and (trace[self._fwd_cursor] == unit.index)
        )

    def _held(self, unit: Unit) -> bool:
        """Whether ``unit``, just run on the traced forward, stays gathered for its next use."""
        position, trace = self._fwd_cursor - 1, self.forward_trace
        if trace is None or not 0 <= position < len(trace) or trace[position] != unit.index:
            return False
        live = sum(u.numel for u in self.units if any(g.flat_param is not None for g in u.groups))
        if not self.reuse.holds(position, live):
            return False
        self.stats["held"] += 1
        return True

    # --- backward ----------------------------------------------------------------------------
    def _pre_backward(self, unit: Unit) -> None:
        if not self._backward_started:
            self._backward_started = True
            self._bwd_cursor = 0
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self._check(
            "backward",
            unit.index,
            settled=not self._expected(unit, self.backward_trace, self._bwd_cursor),
        )
        if self._recording is not None:
            self._recording[1].append(unit.index)
        unit.backward_users += 1
        self._start(unit)
        self._prefetch(self.backward_trace, "_bwd_cursor", unit)
        self._gather(unit)

    def _post_backward(self, unit: Unit) -> None:
        unit.backward_users = max(0, unit.backward_users - 1)
        if unit.backward_users == 0 and not unit.is_root:
            unit_release(unit)

    @staticmethod
    def _expected(unit: Unit, trace: list[int] | None, cursor: int) -> bool:
        """Whether ``unit`` is next on the agreed trace and already gathered or on its way:
        entering it issues no collective the other ranks might not."""
        return (
            trace is not None
            and cursor < len(trace)
            and trace[cursor] == unit.index
            and any(g.flat_param is not None for g in unit.groups)
        )

    def _end_of_backward(self) -> None:
        self._backward_started = False
        self.release_all()
        if self._recording is not None:
            forward, backward = self._recording
            self._recording = None
            self._adopt_traces(forward, backward)

    # --- gather, prefetch, release -----------------------------------------------------------
    def _start(self, unit: Unit) -> None:
        """Count how ``unit`` finds its parameters and start its gather if none is on its way.
        The prefetches issued next then queue right behind it, so the link does not idle while
        this rank waits for the unit it needs now (only the issue order changes: the budgets
        count this unit as gathered either way)."""
        if unit.index in self._prefetched:
            self._prefetched.discard(unit.index)
            self.stats["prefetch_hits"] += 1
        elif not unit.is_gathered:
            self.stats["on_demand_gathers"] += 1
        for group in unit.groups:
            group.gather(async_op=True)

    def _gather(self, unit: Unit) -> None:
        """Wait for ``unit``'s parameters (started by `_start`)."""
        gather_groups(unit.groups)
        for group in unit.groups:
            self.saved.track(group)

    def _gather_on_demand(self, group: FlatParamGroup) -> None:
        """Backward needs a released group's weights (used outside its unit); released with
        everything else at the end of backward."""
        self.stats["on_demand_gathers"] += 1
        self._settle_checks()  # a collective the other ranks may not issue: check first
        gather_groups([group])

    def _prefetch(self, trace: list[int] | None, cursor_name: str, unit: Unit) -> None:
        """Start gathering the units that follow ``unit`` in ``trace``, within the budgets."""
        if trace is None:
            return
        cursor = getattr(self, cursor_name)
        if cursor >= len(trace) or trace[cursor] != unit.index:
            return  # off the traced path: no prefetch this time
        cursor += 1
        setattr(self, cursor_name, cursor)
        live = sum(u.numel for u in self.units if u.is_gathered)
        budget = self.prefetch_numel
        for index in trace[cursor:]:
            nxt = self.units[index]
            if any(g.flat_param is not None for g in nxt.groups):
                continue  # gathered, or already on its way
            if budget <= 0 or live + nxt.numel > self.max_live_numel:
                break
            for group in nxt.groups:
                group.gather(async_op=True)
                self.saved.track(group)
            self._prefetched.add(index)
            budget -= nxt.numel
            live += nxt.numel
        ahead = self.read_ahead
        for index in trace[cursor:]:
            if ahead <= 0:
                break
            groups = [g for g in self.units[index].groups if g.flat_param is None]
            for group in groups:
                group.prefetch_shard()
            ahead -= bool(groups)

    def release_all(self) -> None:
        self._settle_checks()
        self._prefetched.clear()
        self._entered_below.clear()  # entries whose forward raised before leaving
        for unit in self.units:
            unit.backward_users = 0
            unit_release(unit)

    # --- traces and order checks -------------------------------------------------------------
    def _adopt_traces(self, forward: list[int], backward: list[int]) -> None:
        """Prefetch along the first step's order, if every rank saw the same one."""
        mine = torch.tensor([hash((tuple(forward), tuple(backward)))], dtype=torch.int64)
        everyone = torch.zeros(self.control.size, dtype=torch.int64)
        if self.control.size > 1:
            self.comm.all_gather(everyone, mine, self.control)
        else:
            everyone = mine
        if bool((everyone == mine).all()):
            self.forward_trace, self.backward_trace = forward, backward
            self.reuse.adopt(forward, backward, [u.numel for u in self.units])
        else:
            logger.warning(
                "hf_zero: ranks ran units in different orders in the first step; "
                "ZeRO-3 prefetch is disabled"
            )

    def _check(self, event: str, index: int, settled: bool) -> None:
        """Check across ranks that all are at the same unit; raise on every rank if not.

        Reads the answers of earlier checks first (lag one). ``settled``: also wait for this
        one's now, before this rank issues a collective the others might not.
        """
        if not self.check_execution_order or self.control.size == 1:
            return
        self._settle_checks()
        code = index if event != "backward" else -2 - index
        mine = torch.tensor([code], dtype=torch.int64)
        everyone = torch.zeros(self.control.size, dtype=torch.int64)
        work = self.comm.all_gather_native(everyone, mine, self.control, async_op=True)
        self._checks.append((work, everyone, code))
        self.stats["checks"] += 1
        if settled:
            self.stats["checks_waited"] += 1
            self._settle_checks()

    def _settle_checks(self) -> None:
        """Wait for the checks issued so far, oldest first; raise at the first disagreement."""
        while self._checks:
            work, everyone, code = self._checks.pop(0)
            work.wait()
            if bool((everyone == code).all()):
                continue
            self._checks.clear()
            seen = [self._describe(int(c)) for c in everyone]
            raise RuntimeError(
                "hf_zero ZeRO-3: ranks took different paths through the model ("
                + "; ".join(f"rank {r}: {s}" for r, s in zip(self.control.ranks, seen))
                + "). Every rank must run the same modules in the same order, because each one "
                "gathers its parameters with a collective. Make control flow independent of the "
                "rank's data, or use stage 0-2 for this model."
            )

    def _describe(self, code: int) -> str:
        if code == -1:
            return "finished the forward"
        if code <= -2:
            return f"backward of {self.units[-2 - code].name}"
        return f"forward of {self.units[code].name}"

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def unit_release(unit: Unit) -> None:
    for group in unit.groups:
        group.release()


def gather_groups(groups: Iterable[FlatParamGroup], exact: bool = False) -> None:
    """Gather several groups with all their collectives in flight at once, then wait.

    ``exact=True`` bypasses ZeRO++ quantization and secondary shards.
    """
    groups = list(groups)
    for group in groups:
        group.gather(async_op=True, exact=exact)
    for group in groups:
        group.wait_gather()
