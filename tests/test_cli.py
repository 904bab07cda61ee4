"""The hf-zero command."""

import json

from hf_zero.cli import main


def test_config_prints_resolved_settings(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, "gradient_clipping": 1.0}))
    assert main(["config", str(path), "--set", "overlap_comm=false"]) == 0
    out = capsys.readouterr().out
    assert "stage: 2" in out and "gradient_clipping: 1.0" in out and "overlap_comm: false" in out


def test_config_reports_errors(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("stage: 2\nreduce_bucket: 100\n")
    assert main(["config", str(path)]) == 2
    assert (
        "unknown key 'reduce_bucket'; did you mean 'reduce_bucket_size'?" in capsys.readouterr().err
    )


def test_env(capsys):
    assert main(["env"]) == 0
    assert "torch" in capsys.readouterr().out


def test_estimate_from_a_count_and_from_a_local_config(tmp_path, capsys):
    from hf_zero.memory import model_state_bytes
    from hf_zero.tiny import tiny_llama_config

    assert main(["estimate", "--params", "7e9", "--dp", "8"]) == 0
    out = capsys.readouterr().out
    stage3 = model_state_bytes(7e9, 8, 3, "bf16")["total"] / 2**30
    assert f"    3     False {stage3:>11.2f}" in out
    # ZeRO-Infinity's CPU tier: nothing of the model states stays on the device.
    infinity = model_state_bytes(7e9, 8, 3, "bf16", True, offload_param=True)
    assert infinity["total"] == 0
    assert f"    3 opt+param {0:>11.2f} {infinity['host_total'] / 2**30:>9.2f}" in out
    tiny_llama_config().save_pretrained(tmp_path)
    assert main(["estimate", "--model-config", str(tmp_path)]) == 0
    assert "90,432 parameters" in capsys.readouterr().out  # counted on the meta device
    assert main(["estimate"]) == 2
    assert main(["estimate", "--params", "1e9", "--model", "llama-3-8b"]) == 2


def test_estimate_presets_tp_mixz_and_activations(capsys):
    from hf_zero.cli import MODEL_PRESETS

    assert main(["estimate", "--model", "llama-3-8b", "--dp", "8"]) == 0
    out = capsys.readouterr().out
    assert "8,030,261,248 parameters" in out  # Llama 3 8B, counted on the meta device
    assert "activations with checkpointing" in out and "activations without" in out
    # The sizes a config that names none gets under NVMe / parameter offload: 2 h^2 in flight.
    assert f"reductions in flight {2 * 4096**2:,} elements (64 MiB" in out
    assert main(["estimate", "--model", "llama-3-8b", "--dp", "8", "--tp", "2"]) == 0
    tp2 = capsys.readouterr().out
    stage0 = [
        line.split()
        for line in (out, tp2)
        for line in line.splitlines()
        if line.startswith("    0")
    ]
    assert float(stage0[1][2]) < 0.51 * float(stage0[0][2])  # TP halves almost everything
    args = ["estimate", "--model", "llama-3-8b", "--dp", "8", "--trainable-params", "4e7"]
    assert main([*args, "--mixz"]) == 0
    mixz = capsys.readouterr().out
    assert "frozen as INT8 (MixZ++)" in mixz
    assert main([*args, "--mixz", "nf4"]) == 0
    nf4 = capsys.readouterr().out
    assert "frozen as a bitsandbytes NF4 base" in nf4

    def device_gib(text: str, stage: str) -> float:
        rows = [line.split() for line in text.splitlines() if line.startswith(f"{stage:>5} ")]
        return float(rows[0][2])

    # A 4-bit base is quantized at every stage (MixZ++'s INT8 only at stage 3), and at
    # stage 3 costs about 0.56/1.02 of MixZ++'s INT8 shards.
    assert device_gib(nf4, "2") < device_gib(mixz, "2")
    assert device_gib(nf4, "3") < device_gib(mixz, "3")
    assert main(["estimate", "--model", "gpt-17"]) == 2
    assert "known: " + ", ".join(MODEL_PRESETS) in capsys.readouterr().err


def test_estimate_names_its_units_and_why_it_differs_from_the_paper(capsys):
    from hf_zero.memory import formula, model_state_bytes

    assert main(["estimate", "--params", "7e9", "--dp", "8"]) == 0
    out = capsys.readouterr().out
    assert "GiB = 2^30 bytes" in out and "device GiB" in out
    rows = [line.split(None, 5) for line in out.splitlines() if line[:5].strip().isdigit()]
    columns = {(int(r[0]), r[1]): r[5] for r in rows}
    paper = {0: "16P", 1: "4P + 12P/N", 2: "2P + 14P/N", 3: "16P/N"}
    for stage, text in paper.items():  # bf16, one micro-batch per step: the paper's formulas
        assert columns[(stage, "False")].split("  ")[0].strip() == text
        assert columns[(stage, "False")].endswith(text)  # the paper's, alongside
    assert "Kept on purpose: with gradient accumulation" in out and "Resident = " in out
    # With accumulation, stages 2-3 keep an fp32 shard across the window, and say so.
    assert (
        main(["estimate", "--params", "7e9", "--dp", "8", "--gradient-accumulation-steps", "4"])
        == 0
    )
    out = capsys.readouterr().out
    rows = [line.split(None, 5) for line in out.splitlines() if line[:5].strip().isdigit()]
    columns = {(int(r[0]), r[1]): r[5] for r in rows}
    assert columns[(2, "False")].split("  ")[0].strip() == "2P + 16P/N"
    assert columns[(3, "False")].split("  ")[0].strip() == "18P/N"
    assert columns[(1, "False")].split("  ")[0].strip() == "4P + 12P/N"
    # The printed formula is the estimator's own arithmetic, at any P and N.
    for stage, gas in [(s, g) for s in (0, 1, 2, 3) for g in (1, 4)]:
        text = formula(stage, "bf16", gradient_accumulation_steps=gas)
        P, N = 1000.0, 4.0
        value = sum(
            float(term.split("P")[0]) * (P / N if term.endswith("/N") else P)
            for term in text.split(" + ")
        )
        expected = model_state_bytes(P, N, stage, "bf16", gradient_accumulation_steps=gas)
        assert value == expected["total"], (stage, gas, text)


def test_config_names_the_line_of_a_syntax_error(tmp_path, capsys):
    path = tmp_path / "broken.yaml"
    path.write_text("stage: 3\nzero:\n  - a\n b: 1\n")
    assert main(["config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "broken.yaml:4:" in err and "not valid YAML" in err and "Traceback" not in err


def test_estimate_pipeline_stages(capsys):
    """--pp: the largest stage's states per ZeRO stage, activations in flight per schedule (1F1B
    holds p micro-batches, GPipe m) and the bubble (p-1)/(m+p-1), interleaved (p-1)/(2m+p-1)."""
    assert main(["estimate", "--model", "llama-2-7b", "--pp", "4", "--dp", "2",
                 "--gradient-accumulation-steps", "8"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.strip()}
    assert rows["gpipe"][0] == "8" and rows["1f1b"][0] == "4"
    assert float(rows["gpipe"][1]) == 2 * float(rows["1f1b"][1])
    assert rows["1f1b"][2] == f"{3 / 11:.1%}" and rows["interleaved_1f1b"][2] == f"{3 / 19:.1%}"
    assert float(rows["1"][0]) < float(rows["0"][0])  # ZeRO-1 shards the stage's Adam state
    # offload_optimizer cpu: the master shard and Adam state leave the device for the host
    assert rows["0"][1:3] == ["-", "-"]
    for zero in ("1", "2"):
        device, offloaded, host, _ = (float(x) for x in rows[zero])
        assert offloaded < device and host >= device - offloaded - 0.01, rows[zero]
    # bf16 (the default): bf16 master weights and Adam state save 4 + 4 of 16 bytes per
    # parameter of ZeRO-0's stage
    device, small = float(rows["0"][0]), float(rows["0"][3])
    assert abs(small / device - 8 / 16) < 0.01, rows["0"]
    assert main(["estimate", "--params", "7e9", "--pp", "2"]) == 2
    assert "--pp needs the model's layers" in capsys.readouterr().err


def test_estimate_refuses_impossible_sizes_in_one_line(capsys):
    for flags, message in (
        (["--dp", "0"], "argument --dp: 0 is not allowed: at least 1"),
        (["--dp", "-4"], "argument --dp: -4 is not allowed: at least 1"),
        (["--dp", "eight"], "argument --dp: 'eight' is not a whole number"),
        (["--dp", "8", "--hpz", "3"], "--hpz 3 must divide --dp 8"),
    ):
        try:
            status = main(["estimate", "--params", "7e9", *flags])
        except SystemExit as exit:  # argparse's own exit for a bad value
            status = exit.code
        err = capsys.readouterr().err
        assert status == 2 and message in err, (flags, err)
        assert "Traceback" not in err


def test_estimate_says_what_it_cannot_know(capsys):
    assert main(["estimate", "--params", "7e9", "--dp", "8"]) == 0
    out = capsys.readouterr().out
    stage3 = [line for line in out.splitlines() if line.startswith("    3")]
    assert stage3 and all("unknown" in line for line in stage3), stage3  # no layer sizes
    assert "split by AutoTP" not in out  # tp 1
    assert main(["estimate", "--model", "llama-3-8b", "--dp", "8", "--tp", "2"]) == 0
    assert "split by AutoTP" in capsys.readouterr().out
