"""Sharded optimizer (stages 1-2) and its helpers."""

from hf_zero.optim.cpu_adam import CPUAdam, adam_step
from hf_zero.optim.deepspeed_optimizer import build_optimizer
from hf_zero.optim.sharded import ShardedOptimizer, check_elementwise

__all__ = ["CPUAdam", "ShardedOptimizer", "adam_step", "build_optimizer", "check_elementwise"]
