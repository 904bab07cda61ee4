"""`ZeroConfig`: every hf_zero setting in one dataclass.

Sources, all through :meth:`ZeroConfig.load`:

* an hf_zero YAML/JSON file or dict (flat keys named as the fields below),
* an existing DeepSpeed config (read by `hf_zero.config.deepspeed`, where every DeepSpeed key
  has a stated fate: honoured, inherent, no effect, or refused),
* keyword overrides (what CLI flags map to).

Unknown keys raise a ``ValueError`` that names the key and the nearest valid one; so does a
file that does not parse (with its line). Every field below has an effect.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hf_zero.config.checks import AUTO, at_least, int_or_auto, one_of, suggest
from hf_zero.config.files import read_mapping
from hf_zero.config.offload import check_offload_settings, check_storage_dtypes
from hf_zero.config.sequence import check_sequence_settings
from hf_zero.config.world import check_batch_sizes, check_world
from hf_zero.config.zeropp import check_zeropp_settings

PRECISIONS = ("fp32", "bf16", "fp16")
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
STAGES = (0, 1, 2, 3)
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
COMM_DTYPES = (None, "fp32", "bf16", "fp16")


# What "auto" becomes when neither the model nor the training arguments say (DeepSpeed defaults).
AUTO_FALLBACKS = {
    "reduce_bucket_size": 50_000_000,
    "prefetch_bucket_size": 50_000_000,
    "param_persistence_threshold": 100_000,
    "gradient_accumulation_steps": 1,
    "train_micro_batch_size_per_gpu": None,
    "gradient_clipping": 0.0,
    "precision": "fp32",
}


@dataclasses.dataclass
class ZeroConfig:
    """All hf_zero settings. Sizes are in elements, as in DeepSpeed.

    Fields that accept ``"auto"`` are resolved by :meth:`resolved` (a new config) from the model
    (hidden size) or the training arguments, like the Hugging Face DeepSpeed integration does.
    """

    # --- ZeRO stage and precision -------------------------------------------------------------
    stage: int = 0
    """0: data parallel (all-reduce); 1: + optimizer state sharded; 2: + gradients; 3: + parameters."""
    precision: str = "fp32"
    """Compute dtype of the model: ``fp32``, ``bf16`` or ``fp16`` (or ``"auto"``: from the
    training arguments, else fp32). Master weights are fp32 (see ``master_weights_dtype``)."""
    communication_data_type: str | None = None
    """dtype gradients are reduced in; ``None`` means the compute dtype."""
    master_weights_dtype: str = "fp32"
    """``bf16`` (with ``precision: bf16``, no ``offload_optimizer``; pipeline stages too): the
    bf16 parameters are the master weights, no fp32 copy (4 bytes per parameter of the rank's
    shard less; each step computes in fp32 one bucket at a time and rounds back, stochastically).
    DeepSpeed's ``bf16_master_weights_and_grads``."""
    optimizer_states_dtype: str = "fp32"
    """``bf16``: elementwise optimizer state (Adam's moments) kept in bf16 between steps,
    widened to fp32 for each bucket's step (with ``offload_optimizer: cpu``, in host memory,
    a tile at a time). DeepSpeed's ``bf16.bf16_optimizer_states``."""

    # --- fp16 dynamic loss scaling (DeepSpeed's ``fp16`` section) ------------------------------
    loss_scale: float = 0.0
    """0 means dynamic loss scaling; a positive value is a fixed scale."""
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    """Restore the hysteresis after every good step, so only overflows in a row lower the scale."""
    min_loss_scale: float = 1.0

    # --- optimisation ------------------------------------------------------------------------
    gradient_clipping: float | str = 0.0
    """Clip the global gradient norm to this value at each step; 0 disables."""
    gradient_accumulation_steps: int | str = 1
    train_micro_batch_size_per_gpu: int | str | None = None
    train_batch_size: int | str | None = None
    allow_untested_optimizer: bool = False
    """Accept optimizer classes hf_zero has not verified to be elementwise."""
    optimizer: dict | None = None
    """DeepSpeed-style ``{"type": "AdamW", "params": {...}}``, used when no optimizer is passed."""
    scheduler: dict | None = None
    """DeepSpeed-style ``{"type": "WarmupLR", "params": {...}}``: the learning-rate schedule the
    Trainer and `ZeroAccelerator` build (see docs/CONFIG.md)."""

    # --- buckets and overlap -----------------------------------------------------------------
    reduce_bucket_size: int | str = 50_000_000
    """Elements per flat gradient bucket (stages 0-2 also shard the optimizer per bucket)."""
    reduce_inflight_numel: int | str = AUTO
    """Stages 2-3: elements of buckets whose reductions may be in flight at once (each holds
    its full-size gradient until done; one bucket always may go). "auto": two buckets (one on
    the wire, one queued), ``2 x reduce_bucket_size``; where memory is the point (a tier on
    NVMe, or parameters offloaded) ``2 h^2`` instead (h: the model's hidden size), so a large
    bucket size does not hold several units' gradients at once; the prefetch budget's "auto"
    is then at most one unit as well."""
    overlap_comm: bool = True
    """Launch each bucket's reduction as soon as its gradients are ready during backward."""
    native_collectives: bool = False
    """Always call the backend's own reduce-scatter / all-gather. By default, on gloo (CPU),
    they run as direct point-to-point exchanges (same bytes, measured faster; same results)."""
    comm_timeout: int = 1800
    """Seconds a collective may wait for the other ranks before it fails (every group hf_zero
    creates, and the default group when hf_zero creates it; torch's default). Under the Trainer:
    ``--ddp_timeout``, also on CPU."""
    stall_warning_seconds: int = 300
    """A rank blocked in one collective this long logs where it waits and which ranks have not
    arrived (once per stall; well before ``comm_timeout`` ends the job). 0 switches it off."""
    save_on_sigterm: bool = False
    """Under the Trainer: SIGTERM (pre-emption) finishes the optimizer step in flight, saves a
    checkpoint and exits with status 0, instead of ending the process at once. Costs one
    one-element all-reduce per optimizer step (every rank stops at the same step)."""
    profile: bool = False
    """Record where memory and time go, per rank and step (`hf_zero.profiling`), into
    ``profile_dir``; ``hf-zero doctor`` reads it. Off, it costs nothing."""
    profile_steps: int = 5
    """Steps recorded after a first, unrecorded warm-up step."""
    profile_dir: str = "hf_zero_profile"
    host_memory: str = "release"
    """Training on CPU: ``"release"`` gives freed memory back to the OS after each step that
    leaves 16 MiB or more of it (lower RSS); ``"unmap"`` also gives back each freed buffer of
    1 MiB or more at once, inside the step (the lowest peak: long sequences); ``"reuse"`` keeps
    freed memory for the next step, skipping its page faults (faster). With parameters
    offloaded or an NVMe tier, ``release`` unmaps too; ``reuse`` is kept."""

    # --- offload -----------------------------------------------------------------------------
    offload_optimizer: str = "none"
    offload_optimizer_fast_kernel: bool = True
    """Offload: step torch Adam/AdamW with torch's fused CPU kernel, tile by tile (fast; equal to
    ``fused=True``, last-bit different from the default for-loop/foreach AdamW). ``false`` runs
    your optimizer's own ``step()`` on the host, exactly as you configured it."""
    offload_optimizer_ratio: float = 1.0
    """``offload_optimizer: cpu``: the fraction of each rank's master weights, gradients and
    optimizer state kept and stepped on the host, whole buckets from the first built; the rest
    stays on the device and is stepped there first (on a GPU its kernels run while the CPU
    steps the host part). DeepSpeed's ``offload_optimizer.ratio``."""
    offload_param: str = "none"
    """Stage 3: where parameter shards live between gathers: device ("none"), "cpu", "nvme"."""

    # --- ZeRO-Infinity NVMe tiers ------------------------------------------------------------
    nvme_path: str | None = None
    """Directory for swap files (a local NVMe disk) when either offload device is "nvme"; each
    run uses its own sub-directory there, removed when the process ends."""
    offload_param_nvme_path: str | None = None
    """``offload_param: nvme`` only: its own directory (default: ``nvme_path``)."""
    offload_optimizer_nvme_path: str | None = None
    """``offload_optimizer: nvme`` only: its own directory (default: ``nvme_path``)."""
    offload_param_buffer_count: int = 5
    """``offload_param: nvme``: units whose shards are read ahead of use, in the traced order."""
    offload_param_max_in_cpu: int = 0
    """``offload_param: nvme``: parameter elements of this rank's shards also kept in host
    memory (the first units built, whole shards, up to this many), gathered from there and never
    read back from disk; updates are written through to the files. 0: only the read-ahead
    buffers (the smallest memory). DeepSpeed's ``offload_param.max_in_cpu`` (its default 1e9)."""
    offload_optimizer_max_in_cpu: int = 0
    """``offload_optimizer: nvme``: elements of this rank's optimizer shard whose fp32 master,
    gradient and optimizer state are kept (and stepped) in host memory, as ``offload_optimizer:
    cpu`` keeps them: whole buckets, the first built, up to this many; the rest stream from the
    swap files. 0: every bucket streams (the smallest memory); a large value: none does, so the
    step reads and writes no optimizer bytes on disk (16 bytes per cached element in memory)."""
    offload_optimizer_buffer_count: int = 4
    """``offload_optimizer: nvme``: tiles of (master, gradient, state) in flight in the step."""
    nvme_io_threads: int = 4
    """Threads doing swap-file I/O per rank (DeepSpeed ``aio.thread_count``)."""

    # --- ZeRO-3 knobs ------------------------------------------------------------------------
    prefetch_bucket_size: int | str = AUTO
    """Stage 3: elements gathered ahead of use along the traced order ("auto": 0.9 h^2)."""
    param_persistence_threshold: int | str = AUTO
    """Stage 3: parameters with fewer elements stay whole on every rank ("auto": 10 h)."""
    max_live_parameters: int = 1_000_000_000
    """Stage 3: prefetch stops, and no unit is held for reuse, beyond this many gathered
    elements (DeepSpeed's ``stage3_max_live_parameters``)."""
    max_reuse_distance: int = 0
    """Stage 3: a unit stays gathered after its forward when the traced order uses it again
    (later in the forward or in backward) before this many parameter elements are gathered in
    between, within ``max_live_parameters``: backward then neither re-gathers it nor, under
    NVMe, re-reads it. 0: released after each forward unless it runs next (the smallest memory).
    DeepSpeed's ``stage3_max_reuse_distance`` (its default 1e9 holds most of a small model)."""
    check_execution_order: bool = True
    """Stage 3: check at every module entry that all ranks run the same module (one tiny
    all-gather each), so rank-dependent control flow raises instead of deadlocking."""
    save_16bit_model: bool = False
    """Saved models (``save_model``, ``get_state_dict``) at the training precision (bf16/fp16)
    instead of each parameter's dtype before training (fp32 masters for an fp32 model)."""

    # --- ZeRO++ and MixZ++ -------------------------------------------------------------------
    quantized_weights: bool = False
    """ZeRO++ qwZ (stage 3): parameters are all-gathered as blockwise INT8 plus fp32 scales."""
    quantized_weights_bits: int = 8
    """Bits per quantized weight in qwZ: 8 or 4."""
    hpz_partition_size: int | str = 1
    """ZeRO++ hpZ (stage 3): ranks sharing a secondary partition, so the backward gather stays
    inside them; 1 = off, ``"auto"`` = the data-parallel ranks of one node."""
    quantized_gradients: bool = False
    """ZeRO++ qgZ (stages 2-3): gradients reduced by hierarchical quantized all-to-alls."""
    quantized_gradients_bits: int = 8
    """Bits per quantized gradient in qgZ: 8 or 4 (the paper uses 4)."""
    quantized_gradients_error_feedback: bool = False
    """qgZ: carry each quantization residual into the next reduction."""
    quantization_block_size: int = 256
    """Elements per quantization block (one fp32 scale each), for qwZ and qgZ."""
    quantized_nontrainable_weights: bool | str = False
    """MixZ++ (stage 3): frozen weights stored quantized once, for the whole run. ``true`` (or
    ``"int8"``): hf_zero's INT8 blocks (INT4 with ``quantized_weights_bits: 4``); ``"nf4"`` /
    ``"fp4"``: bitsandbytes' 4-bit formats (64-value blocks, one fp32 absmax each)."""

    # --- topology ----------------------------------------------------------------------------
    tp_size: int = 1
    """Tensor-parallel size (AutoTP); ZeRO runs over the ``world / tp_size`` data-parallel ranks."""

    # --- pipeline parallelism ------------------------------------------------------------------
    pp_size: int = 1
    """Pipeline stages; > 1 makes `initialize` return a `PipelineEngine` (``train_batch``). The
    data-parallel size is ``world / (pp_size * tp_size)``."""
    pp_schedule: str = "1f1b"
    """``gpipe``, ``1f1b`` or ``interleaved_1f1b`` (two virtual stages per rank)."""
    pp_microbatches: int | None = None
    """Micro-batches per ``train_batch`` (default: ``gradient_accumulation_steps`` if > 1, else
    ``pp_size``)."""
    pp_partition: str | list = "parameters"
    """Layers per stage: ``parameters`` (balanced), ``uniform``, or a list of layer counts."""
    tp_plan: dict | str | None = None
    """AutoTP: module-name regexes -> styles (winning over the model's own ``tp_plan``), or a
    preset name (``"llama"``) for models that declare none."""
    node_size: int | None = None
    """Ranks per node; default ``LOCAL_WORLD_SIZE``. Set it to simulate several nodes on one host."""

    # --- long sequences (hf_zero.sequence) ------------------------------------------------------
    sp_size: int = 1
    """Ulysses sequence parallelism: ranks per group sharing each sequence (1/sp each). ZeRO
    shards over all ranks; the data loader is sharded over the ``world / sp_size`` groups."""
    tiled_logits: bool | str = AUTO
    """Head and cross-entropy over tiles of tokens (the whole logits never exist); ``auto``
    tiles a batch whose fp32 logits would exceed 256 MiB."""
    logits_tile_tokens: int | str = AUTO
    """Tokens per logits tile; ``auto``: as many as make 64 MiB of fp32 logits."""
    tiled_mlp: bool = False
    """Every ``*.mlp`` module over tiles of the sequence, recomputed in backward."""
    mlp_tile_tokens: int | str = AUTO
    """Tokens per MLP tile; ``auto``: the model's hidden size (as DeepSpeed's TiledMLP)."""
    offload_checkpoints: bool = False
    """Under activation checkpointing, each layer's saved inputs in host memory (CUDA: pinned,
    copied on a side stream); DeepSpeed's ``activation_checkpointing.cpu_checkpointing``."""

    # ------------------------------------------------------------------------------------------
    def __post_init__(self) -> None:
        self.validate()

    # --- loading -----------------------------------------------------------------------------
    @classmethod
    def load(
        cls, source: ZeroConfig | Mapping | str | Path | None = None, **overrides: Any
    ) -> ZeroConfig:
        """Build a config from a file path, a dict (hf_zero or DeepSpeed format) or nothing.

        ``overrides`` (keyword arguments, e.g. ``initialize(..., stage=3)``) add to what a file
        or dict sets; one that contradicts a value it sets explicitly is a ``ValueError`` naming
        both (as a command-line flag against a ``--zero_config`` file is). Values of ``None``
        mean "not given"; a ``ZeroConfig`` source is overridden (it holds defaults too).
        """
        explicit = not isinstance(source, ZeroConfig)
        if isinstance(source, ZeroConfig):
            values = dataclasses.asdict(source)
        elif source is None:
            values = {}
        else:
            raw = read_mapping(source) if isinstance(source, (str, Path)) else dict(source)
            values = values_of(raw)
        for key, value in overrides.items():
            if value is None:
                continue
            check_keys({key: value})
            if explicit and values.get(key, value) not in (value, AUTO):
                where = source if isinstance(source, (str, Path)) else "the config dict"
                raise ValueError(
                    f"hf_zero: the keyword argument {key}={value!r} contradicts '{key}' = "
                    f"{values[key]!r} in {where}; change one of them (a silent override hides "
                    "mistakes)"
                )
            values[key] = value
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> ZeroConfig:
        """A copy with ``changes`` applied (validated like any other source)."""
        check_keys(changes)
        return dataclasses.replace(self, **changes)

    # --- "auto" ------------------------------------------------------------------------------
    def resolved(
        self,
        hidden_size: int | None = None,
        micro_batch_size: int | None = None,
        gradient_accumulation_steps: int | None = None,
        world_size: int | None = None,
        max_grad_norm: float | None = None,
        precision: str | None = None,
        final: bool = True,
    ) -> ZeroConfig:
        """A new config with ``"auto"`` values derived from the model and arguments (this one
        is left as it is).

        Follows the Hugging Face DeepSpeed integration: bucket sizes from ``hidden_size``,
        batch sizes from the training arguments. Fields still ``"auto"`` for lack of information
        fall back to DeepSpeed's defaults, unless ``final=False`` (more is known later: the
        Trainer resolves its arguments first, `initialize` the model's hidden size). A final
        config is read-only: an engine reads it and nothing changes it under the engine.
        """
        out = dataclasses.replace(self)
        h2 = hidden_size * hidden_size if hidden_size else None
        derived = {
            "reduce_bucket_size": h2,
            "prefetch_bucket_size": int(0.9 * h2) if h2 else None,
            "param_persistence_threshold": 10 * hidden_size if hidden_size else None,
            "gradient_accumulation_steps": gradient_accumulation_steps,
            "train_micro_batch_size_per_gpu": micro_batch_size,
            "gradient_clipping": max_grad_norm,
            "precision": precision,
        }
        if out.memory_first and final:
            # Without a hidden size: one unit ahead (a budget under one unit gathers one).
            derived["prefetch_bucket_size"] = derived["prefetch_bucket_size"] or 1
        for name, value in derived.items():
            if getattr(out, name) == AUTO and (value is not None or final):
                setattr(out, name, value if value is not None else AUTO_FALLBACKS[name])
        if out.reduce_inflight_numel == AUTO and out.reduce_bucket_size != AUTO:
            bucket = h2 if out.memory_first and h2 else None
            if bucket is not None or final:
                out.reduce_inflight_numel = 2 * (bucket or out.reduce_bucket_size)
        if out.train_batch_size == AUTO:
            mb, gas = out.train_micro_batch_size_per_gpu, out.gradient_accumulation_steps
            ok = isinstance(mb, int) and isinstance(gas, int) and world_size
            if ok or final:
                out.train_batch_size = mb * gas * world_size if ok else None
        out.validate()
        if final:
            object.__setattr__(out, "_read_only", True)
        return out

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_read_only"):
            raise AttributeError(
                f"hf_zero: cannot set '{name}' on a resolved config (an engine reads it); "
                "build a new one with ZeroConfig.replace(...)"
            )
        super().__setattr__(name, value)

    @property
    def memory_first(self) -> bool:
        """A tier on NVMe, or parameters offloaded: the run exists to fit in memory, so the
        "auto" sizes of prefetch and reductions in flight are the bounded ones."""
        return self.offload_param != "none" or self.offload_optimizer == "nvme"

    def check_batch_sizes(self, world_size: int) -> None:
        """Raise if train_batch_size != micro_batch * gradient_accumulation_steps * dp world."""
        check_batch_sizes(self, world_size)

    def check_world(self, world_size: int) -> None:
        """Raise what `initialize` would refuse for ``world_size`` processes, before any model
        exists (`hf_zero.config.world.check_world`)."""
        check_world(self, world_size)

    @property
    def frozen_format(self) -> str | None:
        """MixZ++'s storage format: None (off), ``"int"`` (hf_zero's blocks), ``"nf4"``,
        ``"fp4"``."""
        frozen = self.quantized_nontrainable_weights
        return None if frozen is False else "int" if frozen is True else frozen

    @property
    def hpz_enabled(self) -> bool:
        return self.hpz_partition_size == AUTO or self.hpz_partition_size > 1

    def nvme_path_for(self, tier: str) -> str | None:
        """The swap directory of ``tier`` ("offload_param" or "offload_optimizer")."""
        return getattr(self, f"{tier}_nvme_path") or self.nvme_path

    # --- validation --------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ``ValueError`` naming the key, the value and what is allowed."""
        one_of("stage", self.stage, STAGES)
        one_of("precision", self.precision, (*PRECISIONS, AUTO))
        one_of("communication_data_type", self.communication_data_type, COMM_DTYPES)
        one_of("offload_optimizer", self.offload_optimizer, OFFLOAD_DEVICES)
        one_of("offload_param", self.offload_param, OFFLOAD_DEVICES)
        one_of("host_memory", self.host_memory, ("release", "unmap", "reuse"))
        at_least("comm_timeout", self.comm_timeout, 1)
        at_least("stall_warning_seconds", self.stall_warning_seconds, 0)
        at_least("profile_steps", self.profile_steps, 1)
        at_least("loss_scale", self.loss_scale, 0.0)
        at_least("initial_scale_power", self.initial_scale_power, 0)
        at_least("loss_scale_window", self.loss_scale_window, 1)
        at_least("hysteresis", self.hysteresis, 1)
        at_least("min_loss_scale", self.min_loss_scale, 0.0)
        if self.gradient_clipping != AUTO:
            at_least("gradient_clipping", self.gradient_clipping, 0.0)
        int_minimums = {
            "gradient_accumulation_steps": 1,
            "reduce_bucket_size": 1,
            "train_micro_batch_size_per_gpu": 1,
            "train_batch_size": 1,
            "prefetch_bucket_size": 0,
            "param_persistence_threshold": 0,
            "reduce_inflight_numel": 1,
        }
        for name, minimum in int_minimums.items():
            value = getattr(self, name)
            if value is not None or name not in (
                "train_micro_batch_size_per_gpu",
                "train_batch_size",
            ):
                setattr(self, name, int_or_auto(name, value, minimum))
        for name, minimum in (
            ("max_live_parameters", 1),
            ("max_reuse_distance", 0),
            ("offload_param_max_in_cpu", 0),
            ("offload_optimizer_max_in_cpu", 0),
        ):
            value = getattr(self, name)
            if isinstance(value, float) and value.is_integer():
                setattr(self, name, int(value))  # DeepSpeed files write 1e9
            at_least(name, getattr(self, name), minimum)
        for name in ("native_collectives", "offload_optimizer_fast_kernel", "overlap_comm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"zero config: '{name}' = {getattr(self, name)!r} must be true or false"
                )
        if not isinstance(self.consecutive_hysteresis, bool):
            raise ValueError(
                f"zero config: 'consecutive_hysteresis' = {self.consecutive_hysteresis!r} must be "
                "true or false"
            )
        check_zeropp_settings(self)
        at_least("tp_size", self.tp_size, 1)
        if self.tp_plan is not None and not isinstance(self.tp_plan, (str, Mapping)):
            raise ValueError(
                f"zero config: 'tp_plan' = {self.tp_plan!r} must be a preset name or a mapping of "
                "module-name regexes to styles"
            )
        if self.node_size is not None:
            at_least("node_size", self.node_size, 1)
        if self.optimizer is not None and not isinstance(self.optimizer, Mapping):
            raise ValueError(
                f"zero config: 'optimizer' = {self.optimizer!r} must be a mapping like "
                '{"type": "AdamW", "params": {"lr": 1e-4}}'
            )
        check_offload_settings(self)
        check_storage_dtypes(self)
        at_least("pp_size", self.pp_size, 1)
        one_of("pp_schedule", self.pp_schedule, PP_SCHEDULES)
        if self.pp_microbatches is not None:
            at_least("pp_microbatches", self.pp_microbatches, 1)
        check_sequence_settings(self)


def values_of(raw: Mapping) -> dict[str, Any]:
    """Field values from an hf_zero mapping, or from a DeepSpeed one."""
    from hf_zero.config.deepspeed import from_deepspeed, is_deepspeed_config

    if is_deepspeed_config(raw, set(ZeroConfig.__dataclass_fields__)):
        return from_deepspeed(raw)
    return check_keys(raw)


def check_keys(values: Mapping) -> dict[str, Any]:
    fields = set(ZeroConfig.__dataclass_fields__)
    for key in values:
        if key not in fields:
            raise ValueError(f"zero config: unknown key '{key}'{suggest(key, fields)}")
    return dict(values)
