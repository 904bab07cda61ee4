"""The Trainer's own flags and hf_zero's ``--zero_*`` flags resolved into one config: settings
that need a 16-bit run (``--zero_master_weights_dtype bf16``) are checked against the run's
``--bf16``, not against the fp32 default that holds before the script's arguments are read."""

import pytest
from transformers import TrainingArguments

from hf_zero.config.sources import resolve_sources
from hf_zero.integrations.trainer_arguments import zero_config_for

STORAGE = {"master_weights_dtype": "bf16", "optimizer_states_dtype": "bf16"}


def _args(tmp_path, **flags) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **flags)


def test_16bit_storage_flags_take_their_precision_from_the_trainer(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_ZERO_CONFIG", raising=False)
    config = zero_config_for(_args(tmp_path, bf16=True), cli=dict(STORAGE))
    assert config.precision == "bf16"
    assert (config.master_weights_dtype, config.optimizer_states_dtype) == ("bf16", "bf16")
    with pytest.raises(ValueError, match=r"'master_weights_dtype' = 'bf16' needs 'precision'"):
        zero_config_for(_args(tmp_path), cli=dict(STORAGE))  # no --bf16: one clear error


def test_hf_zero_run_checks_16bit_storage_before_the_script_sets_its_precision(tmp_path):
    """`hf_zero.run` validates its flags before the script parses ``--bf16``: the precision is
    left to the run; a config file that sets fp32 is still refused at once."""
    config = resolve_sources(dict(STORAGE), None, env={}, precision_from_run=True)
    assert config.precision == "auto"
    path = tmp_path / "zero.yaml"
    path.write_text("precision: fp32\n")
    with pytest.raises(ValueError, match=r"needs 'precision' = 'bf16'.*got 'fp32'"):
        resolve_sources(dict(STORAGE), path, env={}, precision_from_run=True)
