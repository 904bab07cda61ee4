"""The user's optimizer on this rank's master shards (`ShardedOptimizer`, every stage), the fused
CPU Adam of ZeRO-Offload (`CPUAdam`), the streamed NVMe step, and DeepSpeed's ``optimizer`` and
``scheduler`` sections as torch objects."""

from hf_zero.optim.cpu_adam import CPUAdam, adam_step
from hf_zero.optim.deepspeed_optimizer import build_optimizer
from hf_zero.optim.sharded import ShardedOptimizer, check_elementwise

__all__ = ["CPUAdam", "ShardedOptimizer", "adam_step", "build_optimizer", "check_elementwise"]
