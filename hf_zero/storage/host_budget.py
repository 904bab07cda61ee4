"""A budget of host memory handed out first come, first served: how many parameter elements
ZeRO-Infinity keeps in memory of the shards that live in swap files
(``offload_param_max_in_cpu``, DeepSpeed's ``offload_param.max_in_cpu``)."""

from __future__ import annotations


class HostBudget:
    """``limit`` elements, taken whole by whoever asks first and never given back (the shards
    that fit stay cached for the whole run, so which ones are cached never changes)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.taken = max(0, int(limit)), 0

    def take(self, numel: int) -> bool:
        """Reserve ``numel`` elements; False (nothing reserved) when they do not fit."""
        if self.taken + numel > self.limit:
            return False
        self.taken += numel
        return True
