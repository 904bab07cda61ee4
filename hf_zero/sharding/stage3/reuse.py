"""Stage 3: how far ahead each unit is used again, along the traced order.

After a unit's forward, the coordinator keeps it gathered when its next use comes before
``max_reuse_distance`` parameter elements are gathered in between (DeepSpeed's
``stage3_max_reuse_distance``, counted as DeepSpeed does: every unit run in between, repeats too).
The distances depend only on the traces and the units' sizes, so they are computed once, when
the ranks adopt the first step's traces.
"""

from __future__ import annotations

from collections.abc import Sequence


def reuse_distances(
    forward: Sequence[int], backward: Sequence[int], numel: Sequence[int]
) -> list[int | None]:
    """For each position of ``forward``: the elements of the units run between the unit's
    forward there and its next use (later in ``forward``, else in ``backward``), or None when
    it is not used again in the step. ``numel[i]``: unit ``i``'s gathered elements."""
    order = list(forward) + list(backward)
    distances: list[int | None] = []
    for position, index in enumerate(forward):
        between = 0
        found = None
        for later in order[position + 1 :]:
            if later == index:
                found = between
                break
            between += numel[later]
        distances.append(found)
    return distances


class ReuseWindow:
    """Which units to hold gathered from their forward to their next use."""

    def __init__(self, max_distance: int, max_live_numel: int) -> None:
        self.max_distance = max_distance
        self.max_live_numel = max_live_numel
        self._distances: list[int | None] = []

    def adopt(self, forward: Sequence[int], backward: Sequence[int], numel: Sequence[int]) -> None:
        """Take the agreed traces; before this (the first step) nothing is held."""
        if self.max_distance > 0:
            self._distances = reuse_distances(forward, backward, numel)

    def holds(self, position: int, live_numel: int) -> bool:
        """Whether the unit run at ``position`` of the forward trace stays gathered, with
        ``live_numel`` elements gathered now (the unit's own included)."""
        if not 0 <= position < len(self._distances):
            return False
        distance = self._distances[position]
        return (
            distance is not None
            and distance < self.max_distance
            and live_numel <= self.max_live_numel
        )
