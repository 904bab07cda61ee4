"""hf_zero: ZeRO data parallelism for Hugging Face training, built on torch.distributed."""

from hf_zero.config import ZeroConfig
from hf_zero.engine import ZeroEngine, gathered_parameters, initialize
from hf_zero.partitioned_init import load_partitioned, partitioned_init
from hf_zero.topology import Topology, current_device, init_distributed

__version__ = "0.1.0"

__all__ = [
    "Topology",
    "ZeroConfig",
    "ZeroEngine",
    "__version__",
    "current_device",
    "gathered_parameters",
    "init_distributed",
    "initialize",
    "load_partitioned",
    "partitioned_init",
]
