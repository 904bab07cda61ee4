"""Reading a DeepSpeed config: every key DeepSpeed documents has one stated fate here.

`KEYS` is the single table: each dotted key is

* ``honoured`` - it sets the hf_zero field named in the table and takes effect;
* ``inherent`` - it asks for something hf_zero always does (or that cannot differ here), so it
  is accepted silently; the table says why;
* ``no effect`` - it tunes a DeepSpeed mechanism hf_zero does not have; accepted, and named once
  per launch (rank 0) in a warning, with what to use instead;
* ``refused`` - it asks for a feature hf_zero does not implement: a ``ValueError`` names it.

Values that ask for nothing (``enabled: false``, a default like ``prescale_gradients: false``)
are accepted silently whatever the fate. docs/CONFIG.md prints this table
(`markdown_table`); a test keeps the two equal.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from hf_zero.config.checks import AUTO, suggest
from hf_zero.config.deepspeed_parallel import pipeline_values, tp_plan_from_partition_config

HONOURED, INHERENT, NO_EFFECT, REFUSED, SECTION = (
    "honoured",
    "inherent",
    "no effect",
    "refused",
    "section",
)


def _always(value: Any) -> bool:
    return True


def _truthy(value: Any) -> bool:
    return bool(value) and value != "false"


def _enabled_section(value: Any) -> bool:
    """A section like ``{"enabled": true, ...}`` that asks for something."""
    return isinstance(value, Mapping) and _truthy(value.get("enabled", False))


def _not(default: Any) -> Callable[[Any], bool]:
    return lambda value: value != default


@dataclasses.dataclass(frozen=True)
class Fate:
    """What hf_zero does with one DeepSpeed key."""

    kind: str
    detail: str
    """honoured: the hf_zero field it sets; otherwise why, and what to use instead."""
    applies: Callable[[Any], bool] = _always
    """``no effect`` / ``refused`` apply only to values for which this is true."""
    example: Any = None
    """honoured: a value the tests set to check that the field really changes."""


def _h(field: str, example: Any) -> Fate:
    return Fate(HONOURED, field, example=example)


_SECTION = Fate(SECTION, "")
_MONITOR = "use the Trainer's `report_to` / `logging_steps`"
_CHECKPOINTING = (
    "checkpointing is the model's own: `gradient_checkpointing` (Trainer) or "
    "`model.gradient_checkpointing_enable()`"
)
_AIO = (
    "swap files are read and written with O_DIRECT by a thread pool (`aio.thread_count` "
    "threads); libaio's submission knobs do not apply"
)

KEYS: dict[str, Fate] = {
    # --- batch, clipping, optimizer ---------------------------------------------------------
    "train_batch_size": _h("train_batch_size", 8),
    "train_micro_batch_size_per_gpu": _h("train_micro_batch_size_per_gpu", 4),
    "gradient_accumulation_steps": _h("gradient_accumulation_steps", 2),
    "gradient_clipping": _h("gradient_clipping", 1.0),
    "optimizer": _h("optimizer", {"type": "AdamW", "params": {"lr": 1e-4}}),
    "scheduler": _h("scheduler", {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}),
    "zero_allow_untested_optimizer": _h("allow_untested_optimizer", True),
    "communication_data_type": _h("communication_data_type", "bf16"),
    "prescale_gradients": Fate(
        REFUSED, "hf_zero averages gradients in the reduction itself", _truthy
    ),
    "gradient_predivide_factor": Fate(
        REFUSED, "hf_zero averages gradients in the reduction itself", _not(1.0)
    ),
    "sparse_gradients": Fate(REFUSED, "sparse gradients are not supported", _truthy),
    "zero_force_ds_cpu_optimizer": Fate(
        INHERENT, "offloaded steps always run on the host (hf_zero's CPU Adam or your optimizer)"
    ),
    "dataloader_drop_last": Fate(NO_EFFECT, "use the Trainer's `dataloader_drop_last`", _truthy),
    # --- precision --------------------------------------------------------------------------
    "fp16": _SECTION,
    "fp16.enabled": _h("precision", True),
    "fp16.loss_scale": _h("loss_scale", 128.0),
    "fp16.initial_scale_power": _h("initial_scale_power", 8),
    "fp16.loss_scale_window": _h("loss_scale_window", 100),
    "fp16.hysteresis": _h("hysteresis", 4),
    "fp16.consecutive_hysteresis": _h("consecutive_hysteresis", True),
    "fp16.min_loss_scale": _h("min_loss_scale", 4.0),
    "fp16.auto_cast": Fate(
        INHERENT, "the model's parameters are cast to fp16, so its layers compute in fp16"
    ),
    "fp16.fp16_master_weights_and_grads": Fate(
        REFUSED, "master weights and their gradients are always fp32", _truthy
    ),
    "bf16": _SECTION,
    "bf16.enabled": _h("precision", True),
    "bf16.immediate_grad_update": Fate(
        INHERENT, "gradients are reduced into fp32 as each bucket fills, during backward"
    ),
    "bf16.bf16_master_weights_and_grads": _h("master_weights_dtype", True),
    "bf16.bf16_optimizer_states": _h("optimizer_states_dtype", True),
    "bf16.check_grad_overflow": Fate(
        NO_EFFECT, "bf16 needs no loss scaling; non-finite gradients are not skipped", _truthy
    ),
    "amp": Fate(REFUSED, "use `fp16` or `bf16` (hf_zero casts the model itself)", _enabled_section),
    "data_types": _SECTION,
    "data_types.grad_accum_dtype": Fate(
        NO_EFFECT, "gradients always accumulate in fp32", lambda v: v not in (None, "fp32")
    ),
    # --- ZeRO ---------------------------------------------------------------------------------
    "zero_optimization": _SECTION,
    "zero_optimization.stage": _h("stage", 2),
    "zero_optimization.reduce_bucket_size": _h("reduce_bucket_size", 1000),
    "zero_optimization.overlap_comm": _h("overlap_comm", False),
    "zero_optimization.stage3_prefetch_bucket_size": _h("prefetch_bucket_size", 1000),
    "zero_optimization.stage3_param_persistence_threshold": _h("param_persistence_threshold", 10),
    "zero_optimization.stage3_max_live_parameters": _h("max_live_parameters", 1000),
    "zero_optimization.stage3_max_reuse_distance": _h("max_reuse_distance", 1000),
    "zero_optimization.zero_quantized_weights": _h("quantized_weights", True),
    "zero_optimization.zero_hpz_partition_size": _h("hpz_partition_size", 2),
    "zero_optimization.zero_quantized_gradients": _h("quantized_gradients", True),
    "zero_optimization.zero_quantized_nontrainable_weights": _h(
        "quantized_nontrainable_weights", True
    ),
    "zero_optimization.contiguous_gradients": Fate(
        INHERENT, "gradients always live in flat, contiguous buckets"
    ),
    "zero_optimization.reduce_scatter": Fate(
        INHERENT, "stages 1-3 always reduce-scatter (same sums as an all-reduce)"
    ),
    "zero_optimization.allgather_partitions": Fate(
        INHERENT, "updated shards are always all-gathered"
    ),
    "zero_optimization.round_robin_gradients": Fate(
        INHERENT, "a DeepSpeed CPU-offload copy order; hf_zero copies each bucket's own shard"
    ),
    "zero_optimization.load_from_fp32_weights": Fate(
        INHERENT, "checkpoints always restore the fp32 master weights"
    ),
    "zero_optimization.elastic_checkpoint": Fate(
        INHERENT, "checkpoints always reshard on load, to any world size or stage"
    ),
    "zero_optimization.ignore_unused_parameters": Fate(
        INHERENT, "unused parameters get zero gradients (DeepSpeed's default, true)"
    ),
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": Fate(
        INHERENT,
        "saving always gathers whole weights, each in its dtype before training (`save_16bit_model` for the training precision)",
    ),
    "zero_optimization.gather_16bit_weights_on_model_save": Fate(
        INHERENT,
        "saving always gathers whole weights, each in its dtype before training (`save_16bit_model` for the training precision)",
    ),
    "zero_optimization.allgather_bucket_size": Fate(
        NO_EFFECT,
        "each bucket or stage-3 unit is gathered by one collective; size buckets "
        "with `reduce_bucket_size` and prefetch with `stage3_prefetch_bucket_size`",
    ),
    "zero_optimization.sub_group_size": Fate(
        NO_EFFECT, "each bucket is its own optimizer sub-group; size with `reduce_bucket_size`"
    ),
    "zero_optimization.memory_efficient_linear": Fate(
        NO_EFFECT, "hf_zero keeps your modules' own linear layers"
    ),
    "zero_optimization.stage3_module_granularity_threshold": Fate(
        NO_EFFECT, "stage-3 units come from `_no_split_modules` or repeated blocks"
    ),
    "zero_optimization.use_multi_rank_bucket_allreduce": Fate(
        NO_EFFECT, "stage 0 uses one all-reduce per bucket"
    ),
    "zero_optimization.log_trace_cache_warnings": Fate(
        NO_EFFECT, "order mismatches raise (`check_execution_order`)"
    ),
    "zero_optimization.pipeline_loading_checkpoint": Fate(
        NO_EFFECT, "use `hf_zero.load_partitioned`"
    ),
    "zero_optimization.override_module_apply": Fate(NO_EFFECT, "hf_zero does not patch `apply`"),
    "zero_optimization.cpu_offload": Fate(
        REFUSED, "the old spelling: use `offload_optimizer: {device: cpu}`", _truthy
    ),
    "zero_optimization.cpu_offload_params": Fate(
        REFUSED, "the old spelling: use `offload_param: {device: cpu}`", _truthy
    ),
    "zero_optimization.cpu_offload_use_pin_memory": Fate(
        INHERENT, "host buffers are pinned whenever a GPU is present"
    ),
    "zero_optimization.legacy_stage1": Fate(REFUSED, "use stage 1", _truthy),
    "zero_optimization.mics_shard_size": Fate(
        REFUSED,
        "MiCS is not implemented; use `zero_hpz_partition_size`",
        lambda v: v not in (-1, 0),
    ),
    "zero_optimization.mics_hierarchical_params_gather": Fate(
        REFUSED, "MiCS is not implemented; use `zero_hpz_partition_size`", _truthy
    ),
    "zero_optimization.zeropp_loco_param": Fate(
        REFUSED, "LoCo error feedback: use `quantized_gradients_error_feedback`", _truthy
    ),
    "zero_optimization.offload_optimizer": _SECTION,
    "zero_optimization.offload_optimizer.device": _h("offload_optimizer", "cpu"),
    "zero_optimization.offload_optimizer.pin_memory": Fate(
        INHERENT, "host buffers are pinned whenever a GPU is present"
    ),
    "zero_optimization.offload_optimizer.ratio": _h("offload_optimizer_ratio", 0.5),
    "zero_optimization.offload_optimizer.fast_kernel": _h("offload_optimizer_fast_kernel", False),
    "zero_optimization.offload_optimizer.buffer_count": _h("offload_optimizer_buffer_count", 2),
    "zero_optimization.offload_optimizer.fast_init": Fate(
        INHERENT, "initialisation writes each swap file once, sequentially"
    ),
    "zero_optimization.offload_optimizer.nvme_path": _h(
        "offload_optimizer_nvme_path", "/local_nvme"
    ),
    "zero_optimization.offload_param": _SECTION,
    "zero_optimization.offload_param.device": _h("offload_param", "cpu"),
    "zero_optimization.offload_param.pin_memory": Fate(
        INHERENT, "host buffers are pinned whenever a GPU is present"
    ),
    "zero_optimization.offload_param.buffer_count": _h("offload_param_buffer_count", 2),
    "zero_optimization.offload_param.buffer_size": Fate(
        INHERENT, "read-ahead buffers are sized to each unit's shard, so any size fits"
    ),
    "zero_optimization.offload_param.max_in_cpu": _h("offload_param_max_in_cpu", 1000),
    "zero_optimization.offload_param.nvme_path": _h("offload_param_nvme_path", "/local_nvme"),
    "sequence_parallel_size": _h("sp_size", 2),  # DeepSpeed's Ulysses (ALST)
    # --- tensor parallelism -------------------------------------------------------------------
    "tensor_parallel": _SECTION,
    "tensor_parallel.autotp_size": _h("tp_size", 2),
    "tensor_parallel.tp_size": _h("tp_size", 2),
    "tensor_parallel.partition_config": _h(
        "tp_plan", {"layer_specs": [{"patterns": [".*o_proj"], "partition_type": "row"}]}
    ),
    # --- monitoring, profiling and features of DeepSpeed's own engine ------------------------
    "steps_per_print": Fate(NO_EFFECT, _MONITOR),
    "wall_clock_breakdown": Fate(NO_EFFECT, "use `comm_stats` and the benchmarks", _truthy),
    "memory_breakdown": Fate(NO_EFFECT, "use `engine.memory_report()`", _truthy),
    "dump_state": Fate(NO_EFFECT, "use `hf-zero config FILE`", _truthy),
    "tensorboard": Fate(NO_EFFECT, _MONITOR, _enabled_section),
    "wandb": Fate(NO_EFFECT, _MONITOR, _enabled_section),
    "csv_monitor": Fate(NO_EFFECT, _MONITOR, _enabled_section),
    "comet": Fate(NO_EFFECT, _MONITOR, _enabled_section),
    "comms_logger": Fate(NO_EFFECT, "use `engine.comm_stats`", _enabled_section),
    "flops_profiler": Fate(NO_EFFECT, "use torch.profiler", _enabled_section),
    "activation_checkpointing": _SECTION,
    "activation_checkpointing.cpu_checkpointing": _h("offload_checkpoints", True),
    **{
        f"activation_checkpointing.{key}": Fate(NO_EFFECT, _CHECKPOINTING, _truthy)
        for key in (
            "partition_activations",
            "contiguous_memory_optimization",
            "number_checkpoints",
            "synchronize_checkpoint_boundary",
            "profile",
        )
    },
    "aio": _SECTION,
    "aio.thread_count": _h("nvme_io_threads", 2),
    "aio.intra_op_parallelism": _h("nvme_io_threads", 2),
    "aio.block_size": Fate(INHERENT, _AIO),
    "aio.queue_depth": Fate(INHERENT, _AIO),
    "aio.single_submit": Fate(INHERENT, _AIO),
    "aio.overlap_events": Fate(INHERENT, _AIO),
    "aio.use_gds": Fate(REFUSED, "GPUDirect Storage is not implemented", _truthy),
    "checkpoint": Fate(NO_EFFECT, "checkpoints are always validated by name on load"),
    "autotuning": Fate(REFUSED, "autotuning is not implemented", _enabled_section),
    "elasticity": Fate(REFUSED, "elastic batch sizes are not implemented", _enabled_section),
    "curriculum_learning": Fate(REFUSED, "not implemented", _enabled_section),
    "data_efficiency": Fate(REFUSED, "not implemented", _enabled_section),
    "compression_training": Fate(REFUSED, "not implemented", _always),
    # --- pipeline parallelism (DeepSpeed's PipelineModule settings) -------------------------
    "pipeline": _SECTION,
    "pipeline.stages": _h("pp_size", 2),
    "pipeline.partition": _h("pp_partition", "uniform"),
    "pipeline.seed_layers": Fate(
        NO_EFFECT,
        "stages are cut from the built model, which keeps its own initialisation",
        _truthy,
    ),
    "pipeline.activation_checkpoint_interval": Fate(
        NO_EFFECT,
        "use `gradient_checkpointing` (Trainer) or `model.gradient_checkpointing_enable()`",
        _not(0),
    ),
    "pipeline.pipe_partitioned": Fate(
        NO_EFFECT,
        "each TP rank sends its whole activation to the next stage's same TP rank",
        _truthy,
    ),
    "pipeline.grad_partitioned": Fate(
        NO_EFFECT,
        "each TP rank sends its whole activation gradient to the previous stage",
        _truthy,
    ),
    "pipeline.use_reentrant": Fate(NO_EFFECT, "activation checkpointing is the model's own"),
    "seq_parallel_communication_data_type": Fate(
        NO_EFFECT, "sequence-parallel all-to-alls carry the activations in their own dtype"
    ),
    "disable_allgather": Fate(REFUSED, "updated shards must be all-gathered", _truthy),
}
SECTIONS = {key for key, fate in KEYS.items() if fate.kind == SECTION}


def audit(raw: Mapping, prefix: str = "") -> list[str]:
    """Check every key of ``raw`` against `KEYS`; return the ``no effect`` ones that apply.

    Raises ``ValueError`` for an unknown key (naming the nearest known one) and for a refused
    one (naming the key, the value and why).
    """
    ignored: list[str] = []
    for key, value in raw.items():
        path = f"{prefix}{key}"
        fate = KEYS.get(path)
        if fate is None:
            siblings = {k[len(prefix) :] for k in KEYS if k.startswith(prefix) and k != path}
            siblings = {k for k in siblings if "." not in k}
            raise ValueError(
                f"deepspeed config: unknown key '{path}'{suggest(key, siblings)}. "
                f"Allowed here: {', '.join(sorted(siblings))}"
            )
        if fate.kind == SECTION:
            if value is not None and not isinstance(value, Mapping):
                raise ValueError(f"deepspeed config: '{path}' = {value!r} must be a mapping")
            ignored += audit(value or {}, f"{path}.")
        elif fate.kind == REFUSED and fate.applies(value):
            raise ValueError(
                f"deepspeed config: '{path}' = {value!r} is not supported: {fate.detail}"
            )
        elif fate.kind == NO_EFFECT and fate.applies(value):
            ignored.append(path)
    return ignored


def warn_no_effect(keys: list[str]) -> None:
    """One warning per process for ``no effect`` keys, on rank 0 only (the config is read
    several times per launch: by the arguments, the Trainer and the engine)."""
    fresh = [k for k in keys if k not in _warned]
    _warned.update(fresh)
    if not fresh or os.environ.get("RANK", "0") != "0":
        return
    reasons = "; ".join(f"{k} ({KEYS[k].detail})" for k in fresh)
    warnings.warn(
        f"hf_zero: these DeepSpeed settings have no effect in hf_zero: {reasons}", stacklevel=4
    )


_warned: set[str] = set()


def markdown_table() -> str:
    """The table docs/CONFIG.md shows: every key, its fate, and the field or the reason."""
    rows = ["| DeepSpeed key | fate | hf_zero field, or why |", "|---|---|---|"]
    for key, fate in KEYS.items():
        if fate.kind == SECTION:
            continue
        detail = f"`{fate.detail}`" if fate.kind == HONOURED else fate.detail
        rows.append(f"| `{key}` | {fate.kind} | {detail} |")
    return "\n".join(rows)


# ----------------------------------------------------------------------------------------------
# honoured keys -> ZeroConfig values
# ----------------------------------------------------------------------------------------------

_FIELD_OF = {
    key: fate.detail
    for key, fate in KEYS.items()
    if fate.kind == HONOURED
    and fate.detail not in ("precision", "offload_optimizer", "offload_param")
    and not key.startswith("tensor_parallel.")
}  # plain one-to-one copies
_DTYPE_NAMES = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16", "bfp16": "bf16"}


def is_deepspeed_config(raw: Mapping, hf_zero_fields: set[str]) -> bool:
    """True when ``raw`` has a top-level key only DeepSpeed configs have. (Keys both formats
    share, such as ``gradient_clipping``, read the same either way.)"""
    return any(key in KEYS and key not in hf_zero_fields for key in raw)


def from_deepspeed(raw: Mapping) -> dict[str, Any]:
    """Translate a DeepSpeed config dict into ZeroConfig field values (see `KEYS`)."""
    warn_no_effect(audit(raw))
    values: dict[str, Any] = {}
    for key, field in _FIELD_OF.items():
        section, _, name = key.rpartition(".")
        container = _get(raw, section)
        if name in container and container[name] is not None:
            value = container[name]
            values[field] = dict(value) if isinstance(value, Mapping) else value
    if "allow_untested_optimizer" in values:
        values["allow_untested_optimizer"] = bool(values["allow_untested_optimizer"])
    for field in ("master_weights_dtype", "optimizer_states_dtype"):  # true/false -> a dtype
        if field in values:
            values[field] = "bf16" if values[field] is True else "fp32"
    if "communication_data_type" in values:
        values["communication_data_type"] = _dtype(values["communication_data_type"])
    _precision(raw, values)
    for tier in ("offload_optimizer", "offload_param"):
        device = _get(raw, f"zero_optimization.{tier}").get("device", "none")
        if device not in ("none", "cpu", "nvme"):
            raise ValueError(
                f"deepspeed config: 'zero_optimization.{tier}.device' = {device!r} is not "
                "supported; allowed: 'none', 'cpu', 'nvme'"
            )
        values[tier] = device
    pipeline_values(values)
    tp = _get(raw, "tensor_parallel")
    size = tp.get("autotp_size", tp.get("tp_size"))
    if size is not None:
        values["tp_size"] = size
    if "partition_config" in tp:
        values["tp_plan"] = tp_plan_from_partition_config(tp["partition_config"])
    return values


def _get(raw: Mapping, dotted: str) -> Mapping:
    for part in filter(None, dotted.split(".")):
        raw = raw.get(part) or {}
    return raw


def _precision(raw: Mapping, values: dict[str, Any]) -> None:
    fp16_on, bf16_on = _enabled(raw, "fp16"), _enabled(raw, "bf16")
    if fp16_on is True and bf16_on is True:
        raise ValueError(
            "deepspeed config: 'fp16.enabled' and 'bf16.enabled' are both true; enable at most one"
        )
    if fp16_on is True or bf16_on is True:
        values["precision"] = "fp16" if fp16_on is True else "bf16"
    elif AUTO in (fp16_on, bf16_on):
        values["precision"] = AUTO  # the Trainer's --fp16/--bf16 decide
    elif "fp16" in raw or "bf16" in raw:
        values["precision"] = "fp32"  # sections present and disabled


def _enabled(raw: Mapping, name: str) -> bool | str:
    value = _get(raw, name).get("enabled", False)
    if value == AUTO:
        return AUTO
    if not isinstance(value, bool):
        raise ValueError(
            f"deepspeed config: '{name}.enabled' = {value!r}; allowed: true, false, 'auto'"
        )
    return value


def _dtype(value: str) -> str:
    if value not in _DTYPE_NAMES:
        raise ValueError(
            f"deepspeed config: 'communication_data_type' = {value!r}; allowed: "
            + ", ".join(sorted(_DTYPE_NAMES))
        )
    return _DTYPE_NAMES[value]
