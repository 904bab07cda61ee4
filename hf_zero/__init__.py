"""hf_zero: ZeRO data parallelism for Hugging Face training, built on torch.distributed."""

from hf_zero import quiet
from hf_zero._version import __version__
from hf_zero.comm.topology import Topology, current_device, init_distributed
from hf_zero.config import ZeroConfig
from hf_zero.engine import ZeroEngine, initialize
from hf_zero.sharding.stage3.gathered import gathered_parameters
from hf_zero.sharding.stage3.partitioned_init import load_partitioned, partitioned_init
from hf_zero.sharding.stage3.units import num_parameters

quiet.install()  # before PEFT imports bitsandbytes

# The Hugging Face integrations import transformers' Trainer (slow): loaded on first use.
_LAZY = {
    "ZeroAccelerator": "hf_zero.integrations.accelerate",
    "ZeroPlugin": "hf_zero.integrations.accelerate",
    "ZeroTrainer": "hf_zero.integrations.trainer",
    "ZeroTrainerMixin": "hf_zero.integrations.trainer",
    "ZeroTrainingArguments": "hf_zero.integrations.trainer_arguments",
    "merged_state_dict": "hf_zero.integrations.peft",
    "save_merged": "hf_zero.integrations.peft",
    "load_for_inference": "hf_zero.integrations.reload",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hf_zero' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "Topology",
    "ZeroAccelerator",
    "ZeroConfig",
    "ZeroEngine",
    "ZeroPlugin",
    "ZeroTrainer",
    "ZeroTrainerMixin",
    "ZeroTrainingArguments",
    "__version__",
    "current_device",
    "gathered_parameters",
    "init_distributed",
    "initialize",
    "load_for_inference",
    "load_partitioned",
    "merged_state_dict",
    "num_parameters",
    "partitioned_init",
    "save_merged",
]
