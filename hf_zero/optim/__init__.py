"""Sharded optimizer (stages 1-2) and its helpers."""

from hf_zero.optim.sharded import ShardedOptimizer, build_optimizer, check_elementwise

__all__ = ["ShardedOptimizer", "build_optimizer", "check_elementwise"]
