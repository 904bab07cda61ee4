"""Checks of the ZeRO++ and MixZ++ settings: each error names the key, the value and what is
allowed."""

from __future__ import annotations

from hf_zero.config.checks import AUTO, at_least, frozen_storage, int_or_auto, one_of


def check_zeropp_settings(config) -> None:
    """Validate and normalise qwZ, hpZ, qgZ and MixZ++ keys; refuse them below their stage."""
    if config.hpz_partition_size != AUTO:
        config.hpz_partition_size = int_or_auto("hpz_partition_size", config.hpz_partition_size, 1)
    one_of("quantized_weights_bits", config.quantized_weights_bits, (8, 4))
    config.quantized_nontrainable_weights = frozen_storage(config.quantized_nontrainable_weights)
    one_of("quantized_gradients_bits", config.quantized_gradients_bits, (8, 4))
    at_least("quantization_block_size", config.quantization_block_size, 2)
    if config.quantization_block_size % 2:
        raise ValueError(
            f"zero config: 'quantization_block_size' = {config.quantization_block_size} must "
            "be even (INT4 packs two values per byte)"
        )
    zero3_only = {
        "quantized_weights": config.quantized_weights,
        "hpz_partition_size": config.hpz_enabled,
        "quantized_nontrainable_weights": config.quantized_nontrainable_weights,
    }
    for name, on in zero3_only.items():
        if on and config.stage != 3:
            raise ValueError(
                f"zero config: '{name}' = {getattr(config, name)!r} needs 'stage' = 3 "
                f"(it changes how parameters are gathered); got stage {config.stage}"
            )
    if config.quantized_gradients and config.stage < 2:
        raise ValueError(
            f"zero config: 'quantized_gradients' = True needs 'stage' 2 or 3 "
            f"(it replaces the gradient reduce-scatter); got stage {config.stage}"
        )
