"""Unmodified Trainer scripts under hf_zero: `python -m hf_zero.run`, HF_ZERO_CONFIG + autoload.

`tests/scripts/stock_trainer.py` imports only torch and transformers (and TRL with ``--trl``).
It reports the Trainer class it got, whether hf_zero was imported, each parameter's visible size
mid-training (0 when ZeRO-3 has released it) and its final logits on a fixed input; the test
loads the saved model with ``from_pretrained`` and checks it reproduces those logits.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT, assert_reference_run_finished, launch

from hf_zero.run import split_flags

SCRIPT = str(ROOT / "tests" / "scripts" / "stock_trainer.py")
SHARDED = "model.layers.0.self_attn.q_proj.weight"


def _launch_reference(args: list[str], out: Path, env: dict | None = None) -> None:
    """The plain torch run a test compares with; finished when both ranks wrote their report."""
    done = launch(args, env=env, check=False)
    assert_reference_run_finished(done, len(list(out.glob("report_rank*.json"))) == 2)


def _report(out: Path, trained_in: torch.dtype | None = None) -> dict:
    """The script's report, plus how far the saved model's logits are from the ones it printed
    (the saved fp32 master weights cast to ``trained_in`` first, when the run trained in it)."""
    report = json.loads((out / "report_rank0.json").read_text())
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    for p in model.parameters():  # buffers (rotary tables) stay fp32, as in training
        p.data = p.data.to(trained_in or p.dtype)
    ids = torch.randint(2, 96, (32, 16), generator=torch.Generator().manual_seed(1))[:2]
    with torch.no_grad():
        report["reloaded_diff"] = (
            (model(input_ids=ids).logits - torch.tensor(report["logits"])).abs().max().item()
        )
    return report


TRAIN_ARGS = [
    "--max_steps", "6", "--per_device_train_batch_size", "4", "--learning_rate", "3e-3",
    "--report_to", "none", "--save_strategy", "no", "--logging_steps", "1",
    "--disable_tqdm", "true",
]  # fmt: skip
# TRL's configs default to bf16, which transformers refuses on a machine without a GPU unless
# `--use_cpu` is given: a CPU user types `--bf16 false` (or `--use_cpu`, which hf_zero honours).
TRL_ARGS = ["--trl", "--max_length", "32", "--dataset_text_field", "text", "--bf16", "false"]


def _reports(out: Path) -> list[dict]:
    return [json.loads((out / f"report_rank{r}.json").read_text()) for r in (0, 1)]


def _losses(report: dict) -> list[float]:
    return [entry["loss"] for entry in report["log_history"] if "loss" in entry]


def _check_one_data_parallel_group(out: Path, stdout: str) -> None:
    """Both ranks saw world size 2, only rank 0 is the main process, and each step's log line
    was printed once (by rank 0), not once per rank."""
    ranks = _reports(out)
    assert [r["world_size"] for r in ranks] == [2, 2], [r["world_size"] for r in ranks]
    assert [r["is_world_process_zero"] for r in ranks] == [True, False]
    assert stdout.count("'loss': ") == 6, stdout[-3000:]


def test_an_unmodified_trl_script_under_hf_zero_run_is_sharded_and_saves_a_loadable_model(
    tmp_path,
):
    """TRL's SFTTrainer becomes a ZeroTrainer under ``hf_zero.run`` (a script's own Trainer
    subclass: `test_a_trainer_subclass_under_hf_zero_run_is_sharded_and_equals_plain_ddp`)."""
    out = tmp_path / "out"
    args = ["-m", "hf_zero.run", SCRIPT, *TRL_ARGS, "--output_dir", str(out), *TRAIN_ARGS]
    done = launch([*args, "--zero_stage", "3"])
    r = _report(out)
    assert "ZeroTrainer" in r["mro"] and r["hf_zero_imported"], r["mro"]
    assert r["mro"][0] == "SFTTrainer"
    assert r["sizes"][SHARDED] == 0, "ZeRO-3 releases the layer's weights between steps"
    assert r["reloaded_diff"] < 1e-5, r["reloaded_diff"]
    _check_one_data_parallel_group(out, done.stdout)
    assert done.stderr.count("hf_zero: stage 3 over 2 data-parallel ranks") == 1, done.stderr
    # Only what concerns the user: no pin_memory warning from a CPU DataLoader.
    assert "pin_memory" not in done.stderr, done.stderr[-3000:]


GAS_ARGS = [*TRAIN_ARGS, "--gradient_accumulation_steps", "2"]
"""Two micro-batches per step (the pipeline's micro-batches; the others accumulate them)."""


@pytest.fixture(scope="module")
def plain_ddp(tmp_path_factory) -> Path:
    """The script's own Trainer subclass under plain DDP (the user's ``--use_cpu``), once for
    the tests that compare with it."""
    ddp = tmp_path_factory.mktemp("run") / "ddp"
    args = [SCRIPT, "--subclass", "--output_dir", str(ddp), *GAS_ARGS, "--use_cpu", "true"]
    _launch_reference(args, ddp)
    return ddp


def test_bf16_on_cpu_needs_no_use_cpu_under_hf_zero_run(tmp_path):
    """TRL's configs default to bf16; transformers refuses --bf16 without a GPU unless --use_cpu
    is typed. Under hf_zero.run neither the TRL default nor a plain --bf16 needs it, and the
    saved model has the dtype plain DDP saves (fp32 master weights, not bf16). Flags that need a
    bf16 run (bf16 master weights and Adam state) take it from either, though hf_zero.run checks
    its flags before the script has parsed its own."""
    trl = [a for a in TRL_ARGS if a not in ("--bf16", "false")]  # TRL's own default: bf16
    storage = ["--zero_master_weights_dtype", "bf16", "--zero_optimizer_states_dtype", "bf16"]
    for variant in ([], trl):
        out = tmp_path / f"out{len(variant)}"
        bf16 = [] if variant else ["--bf16"]
        args = ["-m", "hf_zero.run", SCRIPT, *variant, *bf16, "--output_dir", str(out)]
        done = launch([*args, *TRAIN_ARGS, "--zero_stage", "2", *(storage if variant else [])])
        assert "hf_zero: stage 2 over 2 data-parallel ranks, bf16" in done.stderr, done.stderr
    # Saved as the same script saves under plain DDP (autocast over fp32 weights): fp32.
    ddp = tmp_path / "ddp"
    _launch_reference(
        [SCRIPT, "--bf16", "--use_cpu", "true", "--output_dir", str(ddp), *TRAIN_ARGS], ddp
    )
    assert _saved_dtypes(tmp_path / "out0") == _saved_dtypes(ddp) == ({"F32"}, "float32")


def _saved_dtypes(out: Path) -> tuple[set[str], str]:
    """The tensor dtypes in ``model.safetensors`` and the ``dtype`` of ``config.json``."""
    raw = (out / "model.safetensors").read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    dtypes = {v["dtype"] for k, v in header.items() if k != "__metadata__"}
    return dtypes, json.loads((out / "config.json").read_text())["dtype"]


def test_a_trainer_subclass_under_hf_zero_run_is_sharded_and_equals_plain_ddp(tmp_path, plain_ddp):
    """The same script twice. Plain (with the user's ``--use_cpu``): stock transformers, hf_zero
    never imported, weights whole. Under ``hf_zero.run --zero_stage 3``, with no device flag: the
    script's own Trainer subclass on top of ``ZeroTrainer``, the layer's weights released between
    steps, one data-parallel group, each step's loss equal to the plain run's (torch DDP), and a
    saved model that reloads to the logits the script saw."""
    zero = tmp_path / "zero"
    plain = _report(plain_ddp)
    assert plain["mro"][:3] == ["MyTrainer", "Trainer", "object"], plain["mro"]
    assert not plain["hf_zero_imported"]
    assert plain["sizes"][SHARDED] == 64 * 64 and plain["reloaded_diff"] < 1e-5
    args = [SCRIPT, "--subclass", "--output_dir", str(zero), *GAS_ARGS, "--zero_stage", "3"]
    done = launch(["-m", "hf_zero.run", *args])
    r = _report(zero)
    assert r["mro"][0] == "MyTrainer" and "ZeroTrainer" in r["mro"], r["mro"]
    assert r["hf_zero_imported"]
    assert r["sizes"][SHARDED] == 0, "ZeRO-3 releases the layer's weights between steps"
    assert r["reloaded_diff"] < 1e-5, r["reloaded_diff"]
    reference, ours = _losses(_reports(plain_ddp)[0]), _losses(_reports(zero)[0])
    assert len(reference) == len(ours) == 6
    assert max(abs(a - b) for a, b in zip(reference, ours)) < 1e-6, (reference, ours)
    _check_one_data_parallel_group(zero, done.stdout)
    assert done.stderr.count("hf_zero: stage 3 over 2 data-parallel ranks") == 1, done.stderr
    assert "pin_memory" not in done.stderr, done.stderr[-3000:]  # only what concerns the user


@pytest.mark.slow
def test_pipeline_stages_under_hf_zero_run_equal_plain_ddp(tmp_path, plain_ddp):
    """``--pp_size 2`` on 4 processes (2 stages x 2 replicas, ZeRO-1 over the replicas), with
    ``--gradient_accumulation_steps 2`` micro-batches per step: each step's loss equals torch
    DDP's on 2 processes with the same accumulation (the replicas see DDP's data shards; the
    reference's Trainer subclass only calls the Trainer's own loss); mid
    training rank 0 holds only its stage; after train() every rank runs the whole model, and
    the saved model reloads to its logits."""
    ddp, pp = plain_ddp, tmp_path / "pp"
    flags = ["--pp_size", "2", "--zero_stage", "1"]
    done = launch(["--num_processes", "4", "-m", "hf_zero.run", SCRIPT, "--output_dir", str(pp),
                   *GAS_ARGS, *flags])  # fmt: skip
    start = "hf_zero: pipeline of 2 stages (1f1b) x 2 data-parallel (ZeRO stage 1)"
    assert done.stderr.count(start) == 1, done.stderr[-3000:]
    reference, ours = _losses(_reports(ddp)[0]), _losses(_report(pp))
    assert len(reference) == len(ours) == 6
    assert max(abs(a - b) for a, b in zip(reference, ours)) < 1e-5, (reference, ours)
    r = _report(pp)
    assert r["world_size"] == 4 and r["sizes"]["model.layers.1.mlp.up_proj.weight"] == 0
    assert r["sizes"][SHARDED] > 0  # layer 0 is stage 0's
    assert r["reloaded_diff"] < 1e-5, r["reloaded_diff"]
    logits = torch.tensor(_reports(ddp)[0]["logits"])
    assert (torch.tensor(r["logits"]) - logits).abs().max() < 1e-4


def test_torchrun_with_the_hf_zero_command_is_one_group_too(tmp_path):
    """`torchrun --no-python hf-zero run script.py ...`: the same drop-in, another launcher."""
    from hf_zero.testing import free_port

    out = tmp_path / "out"
    hf_zero_command = str(Path(sys.executable).parent / "hf-zero")
    done = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
            "--master_port", str(free_port()), "--no-python", hf_zero_command, "run", SCRIPT,
            "--output_dir", str(out), *TRAIN_ARGS, "--zero_stage", "2",
        ],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    _check_one_data_parallel_group(out, done.stdout)
    assert done.stderr.count("hf_zero: stage 2 over 2 data-parallel ranks") == 1


def test_trl_lora_adapter_is_saved_once_and_complete(tmp_path):
    """TRL + LoRA under hf_zero.run: rank 0 alone writes the adapter, with every LoRA tensor."""
    from safetensors.torch import load_file

    out = tmp_path / "out"
    args = [SCRIPT, *TRL_ARGS, "--lora", "--output_dir", str(out), *TRAIN_ARGS]
    done = launch(["-m", "hf_zero.run", *args, "--zero_stage", "3"])
    tensors = load_file(out / "adapter_model.safetensors")
    # r=4 on q_proj and v_proj of 2 layers: 2 layers x 2 modules x (lora_A, lora_B)
    assert len(tensors) == 8 and all(t.numel() > 0 for t in tensors.values()), list(tensors)
    _check_one_data_parallel_group(out, done.stdout)


def test_trl_qlora_under_hf_zero_run_matches_its_own_ddp_run(tmp_path):
    """An unmodified TRL SFTTrainer QLoRA script (bitsandbytes through ``model_init_kwargs``).

    Stage 3 (quantized base gathered as bytes) equals stage 0 (base untouched, whole on every
    rank) exactly. Against the same script under plain DDP (``--use_cpu``) each step's loss is
    within 1e-4 (measured 3.7e-5 from the second step on), because the two do not run the same
    arithmetic: TRL casts QLoRA adapters to bf16, plain DDP then steps bf16 weights in bf16, while
    hf_zero (fp32 here, the script's ``--bf16 false``) computes and keeps master weights in fp32.
    With a 16-bit base (fp32 adapters) the same comparison is exact.

    The hf_zero runs first call ``trainer.evaluate()`` (a baseline before training): under
    stage 3 that evaluation must neither freeze the adapters nor let bitsandbytes' CPU kernel
    repack the base in place, or the training after it would differ from stage 0 and from a DDP
    run that did not evaluate (or fail). Plain DDP itself is not protected: on a CPU with
    AVX512-BF16 the same evaluation repacks its base, and its losses then drift (5e-3 by the
    sixth step, measured), so the DDP reference does not evaluate first."""
    args = [SCRIPT, *TRL_ARGS, "--lora", "--qlora", "nf4", *TRAIN_ARGS]
    _launch_reference(
        [*args, "--output_dir", str(tmp_path / "ddp"), "--use_cpu", "true"], tmp_path / "ddp"
    )
    losses = {"ddp": _losses(_reports(tmp_path / "ddp")[0])}
    args.insert(-len(TRAIN_ARGS), "--evaluate_first")
    for stage in ("0", "3"):
        out = tmp_path / f"zero{stage}"
        done = launch(["-m", "hf_zero.run", *args, "--output_dir", str(out), "--zero_stage", stage])
        _check_one_data_parallel_group(out, done.stdout)
        losses[stage] = _losses(_reports(out)[0])
    baselines = [_reports(tmp_path / f"zero{stage}")[0]["baseline_eval_loss"] for stage in "03"]
    assert baselines[0] == baselines[1] and baselines[0] > 0, baselines
    assert losses["3"] == losses["0"], losses
    assert len(losses["ddp"]) == len(losses["3"]) == 6
    assert max(abs(a - b) for a, b in zip(losses["ddp"], losses["3"])) < 1e-4, losses
    assert losses["ddp"][-1] != losses["ddp"][0]


LOOP = str(ROOT / "tests" / "scripts" / "stock_accelerate_loop.py")


def test_unmodified_accelerate_loop_under_hf_zero_run_equals_plain_ddp(tmp_path):
    """A run_clm_no_trainer-style loop: `accelerate.Accelerator` becomes ZeroAccelerator with
    no device setting; per-step losses, eval perplexity and the saved weights equal plain DDP
    (the same script with Accelerate's own CPU switch)."""
    from safetensors.torch import load_file

    ddp, zero = tmp_path / "ddp", tmp_path / "zero"
    launch([LOOP, "--output_dir", str(ddp)], env={"ACCELERATE_USE_CPU": "true"})
    done = launch(["-m", "hf_zero.run", LOOP, "--output_dir", str(zero), "--zero_stage", "3"])
    reference, ours = (json.loads((d / "results_rank0.json").read_text()) for d in (ddp, zero))
    assert (reference["accelerator"], ours["accelerator"]) == ("Accelerator", "ZeroAccelerator")
    assert reference["num_processes"] == ours["num_processes"] == 2
    assert len(ours["step_losses"]) == len(reference["step_losses"]) == 16
    steps = zip(reference["step_losses"], ours["step_losses"])
    assert max(abs(a - b) for a, b in steps) < 1e-6
    assert ours["perplexity"] == pytest.approx(reference["perplexity"], rel=1e-6)
    assert done.stderr.count("hf_zero: stage 3 over 2 data-parallel ranks, fp32") == 1
    saved, expected = load_file(zero / "model.safetensors"), load_file(ddp / "model.safetensors")
    assert saved.keys() == expected.keys()
    assert max((saved[k] - expected[k]).abs().max().item() for k in saved) < 1e-5


def _site_dir(tmp_path: Path) -> Path:
    """A site directory outside the real environment: ``sitecustomize`` (found through
    PYTHONPATH) hands it to ``site.addsitedir``, which runs its ``.pth`` files exactly as Python
    runs the ones in site-packages."""
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    (site_dir / "sitecustomize.py").write_text(f"import site\nsite.addsitedir({str(site_dir)!r})\n")
    return site_dir


def test_hf_zero_config_alone_activates_through_the_autoload_hook(tmp_path):
    from hf_zero.cli import main as cli

    out, site_dir = tmp_path / "out", _site_dir(tmp_path)
    assert cli(["autoload", "on", "--site-dir", str(site_dir)]) == 0
    env = {
        "HF_ZERO_CONFIG": str(ROOT / "configs" / "zero" / "stage3.yaml"),
        "PYTHONPATH": str(site_dir),
    }
    done = launch([SCRIPT, "--output_dir", str(out), *TRAIN_ARGS], env=env)
    r = _report(out, trained_in=torch.bfloat16)  # stage3.yaml trains in bf16
    assert "ZeroTrainer" in r["mro"] and r["sizes"][SHARDED] == 0
    assert r["reloaded_diff"] < 1e-5
    _check_one_data_parallel_group(out, done.stdout)


def test_autoload_hook_imports_nothing_when_unset_and_nothing_after_uninstall(tmp_path):
    """The .pth line costs an environment lookup; with hf_zero gone it stays silent."""
    from hf_zero.cli import main as cli

    site_dir = _site_dir(tmp_path)
    assert cli(["autoload", "on", "--site-dir", str(site_dir)]) == 0
    probe = "import sys; print(sorted(m for m in ('torch', 'hf_zero', 'transformers') if m in sys.modules))"
    env = {k: v for k, v in os.environ.items() if k != "HF_ZERO_CONFIG"}
    env["PYTHONPATH"] = str(site_dir)

    def run(extra: dict, cwd: Path = ROOT) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", probe], env={**env, **extra}, capture_output=True, text=True,
            timeout=120, cwd=cwd,
        )  # fmt: skip

    unset = run({})
    assert unset.returncode == 0 and unset.stdout.strip() == "[]" and not unset.stderr
    hooked = run({"HF_ZERO_CONFIG": "x.yaml"})
    assert "'hf_zero'" in hooked.stdout and "'transformers'" not in hooked.stdout, hooked.stderr
    # "Uninstalled": an interpreter where hf_zero cannot be found, the .pth line still there.
    base = getattr(sys, "_base_executable", sys.executable)
    isolated = tmp_path / "isolated"
    isolated.mkdir()
    gone = subprocess.run(
        [base, "-c", "import importlib.util as u; assert u.find_spec('hf_zero') is None"],
        env={**env, "HF_ZERO_CONFIG": "x.yaml", "PYTHONPATH": str(site_dir)},
        capture_output=True, text=True, timeout=120, cwd=isolated,
    )  # fmt: skip
    if "AssertionError" in gone.stderr:
        pytest.skip("hf_zero is importable from the base interpreter: cannot simulate removal")
    assert gone.returncode == 0 and not gone.stderr, gone.stderr


def test_flags_are_split_from_the_script_arguments():
    values, config, rest = split_flags(
        [
            "--output_dir", "o", "--zero_stage", "3", "--zero_quantized_weights",
            "--zero_hpz_partition_size=auto", "--zero_config", "c.yaml", "--tp_size", "2",
            "--zero_quantized_gradients", "false", "--lr", "1",
        ]
    )  # fmt: skip
    assert rest == ["--output_dir", "o", "--lr", "1"]
    assert config == "c.yaml"
    assert values == {
        "stage": 3,
        "quantized_weights": True,
        "hpz_partition_size": "auto",
        "tp_size": 2,
        "quantized_gradients": False,
    }
    with pytest.raises(ValueError, match="--zero_stage 'three'"):
        split_flags(["--zero_stage", "three"])


def test_bad_settings_fail_before_the_script_runs(tmp_path):
    marker = tmp_path / "ran"
    script = tmp_path / "script.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    done = subprocess.run(
        [sys.executable, "-m", "hf_zero.run", str(script), "--zero_stage", "5"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "'stage' = 5 is not allowed" in done.stderr
    assert not marker.exists()
    # hf_zero flags may come before the script, as accelerate's own do before theirs.
    flags_first = [sys.executable, "-m", "hf_zero.run", "--zero_stage", "5", str(script)]
    done = subprocess.run(flags_first, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "'stage' = 5 is not allowed" in done.stderr
    done = subprocess.run(flags_first[:-1], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "no script (a .py file) was given" in done.stderr
