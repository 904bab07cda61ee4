"""ZeroConfig: hf_zero files, DeepSpeed files (the Hugging Face docs' examples), errors."""

import contextlib
import json
import warnings

import pytest
from helpers import ROOT

from hf_zero import ZeroConfig
from hf_zero.config import deepspeed as ds_config
from hf_zero.config.sources import explicit_values


@pytest.fixture(autouse=True)
def _fresh_warnings():
    """Each test sees the once-per-process DeepSpeed warning afresh."""
    ds_config._warned.clear()


def is_deepspeed_config(raw):
    return ds_config.is_deepspeed_config(raw, set(ZeroConfig.__dataclass_fields__))


FP16_AUTO = {
    "enabled": "auto",
    "loss_scale": 0,
    "loss_scale_window": 1000,
    "initial_scale_power": 16,
    "hysteresis": 2,
    "min_loss_scale": 1,
}
OPTIMIZER_AUTO = {
    "type": "AdamW",
    "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
}
SCHEDULER_AUTO = {
    "type": "WarmupLR",
    "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
}
BATCH_AUTO = {
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}
# The ZeRO-2 and ZeRO-3 examples of the Hugging Face DeepSpeed integration guide.
DS_ZERO2 = {
    "fp16": FP16_AUTO,
    "bf16": {"enabled": "auto"},
    "optimizer": OPTIMIZER_AUTO,
    "scheduler": SCHEDULER_AUTO,
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "allgather_partitions": True,
        "allgather_bucket_size": 2e8,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": 2e8,
        "contiguous_gradients": True,
    },
    **BATCH_AUTO,
}
DS_ZERO3 = {
    "fp16": FP16_AUTO,
    "bf16": {"enabled": "auto"},
    "optimizer": OPTIMIZER_AUTO,
    "scheduler": SCHEDULER_AUTO,
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    **BATCH_AUTO,
}


def _load_quiet(source, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ZeroConfig.load(source, **kw)


def test_defaults_are_valid():
    cfg = ZeroConfig()
    assert cfg.stage == 0 and cfg.precision == "fp32" and cfg.gradient_accumulation_steps == 1


def test_hf_docs_zero2_example_loads(tmp_path):
    path = tmp_path / "ds_zero2.json"
    path.write_text(json.dumps(DS_ZERO2))
    with pytest.warns(UserWarning, match="allgather_bucket_size.*steps_per_print"):
        cfg = ZeroConfig.load(path)
    assert cfg.stage == 2
    assert cfg.offload_optimizer == "cpu"
    assert cfg.reduce_bucket_size == 200_000_000 and isinstance(cfg.reduce_bucket_size, int)
    assert cfg.precision == "auto" and cfg.gradient_accumulation_steps == "auto"
    assert cfg.optimizer["type"] == "AdamW"
    cfg = cfg.resolved(
        hidden_size=64,
        micro_batch_size=4,
        gradient_accumulation_steps=2,
        world_size=2,
        max_grad_norm=1.0,
        precision="bf16",
    )
    assert cfg.train_micro_batch_size_per_gpu == 4
    assert cfg.gradient_accumulation_steps == 2
    assert cfg.train_batch_size == 16
    assert cfg.gradient_clipping == 1.0
    assert cfg.precision == "bf16"
    assert cfg.reduce_bucket_size == 200_000_000  # explicit values are not "auto"


def test_hf_docs_zero3_example_loads_and_resolves_from_hidden_size(tmp_path):
    path = tmp_path / "ds_zero3.json"
    path.write_text(json.dumps(DS_ZERO3))
    # The Hugging Face docs' ZeRO-3 file, unchanged: parameters and optimizer offloaded to CPU.
    cfg = _load_quiet(path)
    assert cfg.stage == 3
    assert cfg.offload_param == "cpu" and cfg.offload_optimizer == "cpu"
    nvme = json.loads(json.dumps(DS_ZERO3))
    nvme["zero_optimization"]["offload_param"]["device"] = "nvme"
    path.write_text(json.dumps(nvme))
    # NVMe (ZeRO-Infinity) is supported, and needs a directory for its swap files.
    with pytest.raises(ValueError, match=r"'offload_param' = 'nvme' needs 'nvme_path'"):
        _load_quiet(path)
    nvme["zero_optimization"]["offload_param"]["nvme_path"] = str(tmp_path)
    path.write_text(json.dumps(nvme))
    assert _load_quiet(path).nvme_path_for("offload_param") == str(tmp_path)
    assert cfg.max_live_parameters == 10**9 and isinstance(cfg.max_live_parameters, int)
    given = cfg
    cfg = cfg.resolved(hidden_size=64)
    assert given.reduce_bucket_size == "auto"  # a new config; the one given stays as it was
    with pytest.raises(AttributeError, match="cannot set 'stage' on a resolved config"):
        cfg.stage = 2  # an engine reads it: nothing changes it under the engine
    assert cfg.replace(max_live_parameters=7).max_live_parameters == 7 and cfg.stage == 3
    assert cfg.reduce_bucket_size == 64 * 64
    assert cfg.prefetch_bucket_size == int(0.9 * 64 * 64)
    assert cfg.param_persistence_threshold == 10 * 64
    # Nothing known about the batch: "auto" falls back to the defaults.
    assert cfg.gradient_accumulation_steps == 1
    assert cfg.precision == "fp32"
    assert cfg.gradient_clipping == 0.0


def test_deepspeed_zeropp_and_tp_keys_map():
    ds = {
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "zero_quantized_weights": True,
            "zero_hpz_partition_size": 2,
            "zero_quantized_gradients": True,
            "zero_quantized_nontrainable_weights": True,
        },
        "tensor_parallel": {"autotp_size": 2},
        "gradient_clipping": 1.0,
        "zero_allow_untested_optimizer": True,
    }
    cfg = ZeroConfig.load(ds)
    assert (cfg.quantized_weights, cfg.hpz_partition_size, cfg.quantized_gradients) == (
        True,
        2,
        True,
    )
    assert cfg.quantized_nontrainable_weights and cfg.tp_size == 2
    assert cfg.precision == "bf16" and cfg.gradient_clipping == 1.0
    assert cfg.allow_untested_optimizer


def test_hf_zero_yaml_and_overrides(tmp_path):
    path = tmp_path / "zero.yaml"
    path.write_text("stage: 1\nprecision: bf16\ngradient_clipping: 1.0\nreduce_bucket_size: 5e7\n")
    cfg = ZeroConfig.load(path, stage=1, precision=None, overlap_comm=False)
    assert cfg.stage == 1 and not cfg.overlap_comm  # agrees with the file; adds to it
    assert cfg.precision == "bf16"  # None means "not given"
    with pytest.raises(ValueError, match=r"keyword argument stage=2 contradicts 'stage' = 1 in"):
        ZeroConfig.load(path, stage=2)  # initialize(..., config=path, stage=2)
    assert ZeroConfig.load(ZeroConfig.load(path), stage=2).stage == 2  # a ZeroConfig: replaced
    # hf_zero.run's flags against its --zero_config: the message names the flag as typed.
    from hf_zero.config.sources import resolve_sources

    with pytest.raises(ValueError, match=r"--zero_stage 2 contradicts 'stage' = 1 in"):
        resolve_sources({"stage": 2}, path, env={})
    assert cfg.reduce_bucket_size == 50_000_000
    assert not is_deepspeed_config({"stage": 1, "precision": "bf16"})
    assert is_deepspeed_config({"zero_optimization": {"stage": 1}})


@pytest.mark.parametrize(
    ("source", "match"),
    [
        ({"stgae": 2}, r"unknown key 'stgae'; did you mean 'stage'\?"),
        ({"zero_optimization": {"stgae": 2}}, r"'zero_optimization.stgae'.*did you mean 'stage'"),
        ({"train_batch_sise": 8, "fp16": {}}, r"unknown key 'train_batch_sise'.*train_batch_size"),
        ({"fp16": {"enabeld": True}}, r"'fp16.enabeld'.*did you mean 'enabled'"),
    ],
)
def test_unknown_keys_name_the_nearest_valid_one(source, match):
    with pytest.raises(ValueError, match=match):
        ZeroConfig.load(source)


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ({"stage": 5}, r"'stage' = 5 is not allowed; expected one of 0, 1, 2, 3"),
        (
            {"host_memory": "keep"},
            r"'host_memory' = 'keep' is not allowed.*'release', 'unmap', 'reuse'",
        ),
        ({"precision": "fp8"}, r"'precision' = 'fp8' is not allowed"),
        ({"gradient_clipping": -1.0}, r"'gradient_clipping' = -1.0 must be a number >= 0"),
        ({"gradient_accumulation_steps": 0}, r"'gradient_accumulation_steps' = 0 must be an int"),
        ({"reduce_bucket_size": 1.5}, r"'reduce_bucket_size' = 1.5 must be an integer"),
        ({"hysteresis": 0}, r"'hysteresis' = 0 must be an integer >= 1"),
        ({"offload_optimizer": "nvme", "stage": 2}, r"'offload_optimizer' = 'nvme'"),
        ({"offload_optimizer": "cpu"}, r"'offload_optimizer' = 'cpu' needs 'stage' 1, 2 or 3"),
        ({"quantized_weights": True, "stage": 2}, r"'quantized_weights' = True needs 'stage' = 3"),
        ({"hpz_partition_size": 2, "stage": 1}, r"'hpz_partition_size' = 2 needs 'stage' = 3"),
        (
            {"quantized_gradients": True, "stage": 1},
            r"'quantized_gradients' = True needs 'stage' 2",
        ),
        ({"tp_size": 0}, r"'tp_size' = 0 must be an integer >= 1"),
        ({"hpz_partition_size": "auto", "stage": 2}, r"'hpz_partition_size' = 'auto' needs"),
        ({"hpz_partition_size": "half", "stage": 3}, r"'hpz_partition_size' = 'half' must be"),
        ({"quantized_weights_bits": 2}, r"'quantized_weights_bits' = 2 is not allowed"),
        ({"quantized_gradients_bits": 16}, r"'quantized_gradients_bits' = 16 is not allowed"),
        ({"quantization_block_size": 63}, r"'quantization_block_size' = 63 must be even"),
        ({"quantization_block_size": 0}, r"'quantization_block_size' = 0 must be an integer"),
    ],
)
def test_impossible_values_name_key_value_and_allowed(values, match):
    with pytest.raises(ValueError, match=match):
        ZeroConfig.load(values)


def test_deepspeed_contradictions_and_unsupported_values():
    with pytest.raises(ValueError, match=r"'fp16\.enabled' and 'bf16\.enabled' are both true"):
        ZeroConfig.load({"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    with pytest.raises(ValueError, match=r"'offload_optimizer' = 'nvme' needs 'stage' = 3"):
        ZeroConfig.load(
            {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}}
        )
    with pytest.raises(ValueError, match=r"offload_optimizer.device' = 'disk' is not supported"):
        ZeroConfig.load(
            {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "disk"}}}
        )
    with pytest.raises(ValueError, match=r"'fp16.enabled' = 'yes'"):
        ZeroConfig.load({"fp16": {"enabled": "yes"}})


def test_no_effect_keys_are_warned_once_per_launch_on_rank_zero(monkeypatch):
    ds = {
        "zero_optimization": {"stage": 1, "allgather_bucket_size": 5e8, "sub_group_size": 1e9},
        "flops_profiler": {"enabled": True},
    }
    with pytest.warns(UserWarning) as record:
        ZeroConfig.load(ds)
        explicit_values(ds)  # the Trainer reads the same file again: no second warning
    assert len(record) == 1, [str(r.message) for r in record]
    message = str(record[0].message)
    for key in ("flops_profiler", "allgather_bucket_size", "sub_group_size"):
        assert key in message
    assert "use torch.profiler" in message  # each with what to use instead
    ds_config._warned.clear()
    monkeypatch.setenv("RANK", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ZeroConfig.load(ds)  # other ranks stay quiet


def test_inherent_and_inactive_keys_are_silent():
    ds = {
        "zero_optimization": {
            "stage": 2, "contiguous_gradients": True, "reduce_scatter": True,
            "round_robin_gradients": True, "ignore_unused_parameters": True,
            "offload_optimizer": {"device": "none", "pin_memory": True},
        },
        "fp16": {"enabled": False, "auto_cast": False},
        "bf16": {"enabled": True, "immediate_grad_update": True},
        "flops_profiler": {"enabled": False}, "wall_clock_breakdown": False,
        "prescale_gradients": False, "amp": {"enabled": False},
    }  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = ZeroConfig.load(ds)
    assert cfg.stage == 2 and cfg.precision == "bf16"


@pytest.mark.parametrize(
    ("ds", "match"),
    [
        ({"zero_optimization": {"mics_shard_size": 8}}, r"'zero_optimization.mics_shard_size' = 8 is not supported: MiCS"),
        ({"prescale_gradients": True}, r"'prescale_gradients' = True is not supported"),
        ({"amp": {"enabled": True}}, r"'amp' = .* use `fp16` or `bf16`"),
        ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}, r"always fp32"),
        ({"pipeline": {"partition": "type:LlamaDecoderLayer"}}, r"'pipeline.partition' = 'type:Llama.*allowed: 'parameters'"),
    ],
)  # fmt: skip
def test_refused_keys_name_key_value_and_why(ds, match):
    with pytest.raises(ValueError, match=match):
        ZeroConfig.load(ds)


def test_partial_offload_ratio_is_read_and_checked():
    cfg = ZeroConfig.load(
        {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}}
    )
    assert (cfg.offload_optimizer, cfg.offload_optimizer_ratio) == ("cpu", 0.3)
    nvme = {"device": "nvme", "nvme_path": "/tmp", "ratio": 0.3}
    with pytest.raises(
        ValueError, match=r"'offload_optimizer_ratio' = 0.3 needs 'offload_optimizer' = 'cpu'"
    ):
        ZeroConfig.load({"zero_optimization": {"stage": 3, "offload_optimizer": nvme}})
    with pytest.raises(
        ValueError, match=r"'offload_optimizer_ratio' = 1.5 must be a number from 0 to 1"
    ):
        ZeroConfig(stage=2, offload_optimizer="cpu", offload_optimizer_ratio=1.5).validate()


def test_deepspeed_pipeline_section():
    cfg = ZeroConfig.load(
        {"pipeline": {"stages": 4, "partition": "best", "pipe_partitioned": False}}
    )
    assert cfg.pp_size == 4 and cfg.pp_partition == "parameters"
    cfg = ZeroConfig.load({"pipeline": {"stages": "auto", "partition": "uniform"}}, pp_size=2)
    assert cfg.pp_size == 2 and cfg.pp_partition == "uniform"
    with pytest.warns(UserWarning, match="pipeline.activation_checkpoint_interval"):
        ZeroConfig.load({"pipeline": {"activation_checkpoint_interval": 1}})


def test_every_honoured_deepspeed_key_sets_its_field():
    for key, fate in ds_config.KEYS.items():
        if fate.kind != ds_config.HONOURED:
            continue
        *sections, name = key.split(".")
        raw = {name: fate.example}
        for section in reversed(sections):
            raw = {section: raw}
        raw.setdefault("zero_optimization", {}).setdefault("stage", 3)
        if key == "zero_optimization.offload_optimizer.ratio":  # partial offload of a cpu tier
            raw["zero_optimization"]["offload_optimizer"]["device"] = "cpu"
        storage = fate.detail in ("master_weights_dtype", "optimizer_states_dtype")
        if storage:  # 16-bit storage of a bf16 run: true becomes "bf16"
            raw["bf16"]["enabled"] = True
        values = ds_config.from_deepspeed(raw)
        assert fate.detail in values, key
        if fate.detail not in ("precision", "tp_plan", "stage"):
            assert values[fate.detail] == ("bf16" if storage else fate.example), key
        ZeroConfig(**values)  # and the value is valid


def test_docs_show_the_deepspeed_key_table_the_code_uses():
    docs = (ROOT / "docs" / "CONFIG.md").read_text()
    assert ds_config.markdown_table() in docs


def test_consecutive_hysteresis_restores_hysteresis_after_each_good_step():
    from hf_zero.numerics.precision import LossScaler

    for consecutive, expected in ((False, 2.0**15), (True, 2.0**16)):
        scaler = LossScaler(2.0**16, dynamic=True, hysteresis=2, consecutive_hysteresis=consecutive)
        for overflow in (True, False, True):  # two overflows, not in a row
            scaler.update(overflow)
        assert scaler.scale == expected, consecutive
    assert ZeroConfig.load(
        {"fp16": {"enabled": True, "consecutive_hysteresis": True}}
    ).consecutive_hysteresis


def test_syntax_errors_name_the_file_and_line(tmp_path):
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("stage: 3\nprecision: [bf16\n")
    with pytest.raises(ValueError, match=r"bad.yaml:\d+:\d+: not valid YAML"):
        ZeroConfig.load(bad_yaml)
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('{"zero_optimization": {"stage": 3,}}')
    with pytest.raises(ValueError, match=r"bad.json:1:\d+: not valid JSON"):
        ZeroConfig.load(bad_json)


def test_missing_file_and_batch_size_mismatch(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        ZeroConfig.load(tmp_path / "nope.yaml")
    cfg = ZeroConfig.load(
        {
            "train_batch_size": 12,
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 2,
        }
    )
    with pytest.raises(ValueError, match=r"'train_batch_size' = 12 must equal .* = 8"):
        cfg.check_batch_sizes(world_size=2)
    cfg.check_batch_sizes(world_size=3)  # 2 x 2 x 3 = 12: fine


# Copies of the Hugging Face / DeepSpeed docs' JSON, kept verbatim to show that such a file runs
# unchanged: they carry keys that have no effect here, and say so.
VERBATIM_DOCS_COPIES = {"ds_zero3_offload.json", "ds_zero3_nvme.json"}


@pytest.mark.parametrize(
    "path",
    [
        p
        for p in sorted((ROOT / "configs" / "zero").iterdir())
        if p.name not in VERBATIM_DOCS_COPIES
    ],
    ids=lambda p: p.name,
)
def test_shipped_configs_load_without_warnings(path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ZeroConfig.load(path)


# --- the settings table and the places made from it -------------------------------------------


def test_every_place_that_takes_flags_is_made_from_the_settings_table(tmp_path):
    import argparse
    import dataclasses
    import sys

    from hf_zero import ZeroTrainingArguments
    from hf_zero.cli import main as cli_main
    from hf_zero.config.settings import CONFIG_FILE_FLAG, SETTINGS, flags_markdown
    from hf_zero.run import FLAGS

    names = {CONFIG_FILE_FLAG, *(n for s in SETTINGS for n in s.names)}
    assert {s.flag for s in SETTINGS} == {f"zero_{s.key}" for s in SETTINGS}  # the naming rule
    fields = {f.name: f for f in dataclasses.fields(ZeroTrainingArguments)}
    assert names <= fields.keys()
    for s in SETTINGS:
        assert fields[s.flag].metadata["help"] == s.help
    assert set(FLAGS) == {f"--{n}" for n in names}
    doc = (ROOT / "docs" / "CONFIG.md").read_text()
    assert flags_markdown() in doc
    sys.path.insert(0, str(ROOT / "recipes"))
    try:
        import train_tiny
    finally:
        sys.path.pop(0)
    for spelling in ("--zero_offload_optimizer", "--offload_optimizer"):
        args = train_tiny.parse_args([spelling, "cpu"])
        assert args.zero == {"stage": 2, "offload_optimizer": "cpu"}, spelling
    assert isinstance(train_tiny.parse_args([]), argparse.Namespace)
    out = tmp_path / "flags.md"
    with open(out, "w") as f, contextlib.redirect_stdout(f):
        assert cli_main(["config", "--flags"]) == 0
    assert out.read_text() == flags_markdown()


def test_two_spellings_of_one_setting_must_agree(tmp_path):
    from hf_zero import ZeroTrainingArguments
    from hf_zero.run import split_flags

    same, _, rest = split_flags(["--tp_size", "1", "--zero_tp_size", "1", "--lr", "3"])
    assert same == {"tp_size": 1} and rest == ["--lr", "3"]
    with pytest.raises(ValueError, match=r"--zero_pp_size 2 and --pp_size 1 set 'pp_size' twice"):
        split_flags(["--zero_pp_size", "2", "--pp_size", "1"])
    args = ZeroTrainingArguments(output_dir=str(tmp_path), offload_optimizer="cpu", zero_stage=2)
    assert args.zero.offload_optimizer == "cpu" and args.zero_setting_given("offload_optimizer")
    with pytest.raises(ValueError, match=r"set 'offload_optimizer' twice"):
        ZeroTrainingArguments(
            output_dir=str(tmp_path), offload_optimizer="cpu", zero_offload_optimizer="nvme"
        )
