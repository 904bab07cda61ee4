"""Settings: `ZeroConfig` (hf_zero's own format, validated), where settings come from (flags,
``--zero_config``, ``$HF_ZERO_CONFIG``) and the DeepSpeed JSON reader with its table of keys.

The first layer: it imports nothing else from hf_zero.
"""

from hf_zero.config.checks import AUTO
from hf_zero.config.zero_config import ZeroConfig, check_keys, read_mapping, values_of

__all__ = ["AUTO", "ZeroConfig", "check_keys", "read_mapping", "values_of"]
