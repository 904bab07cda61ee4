"""The ``long`` mark, and parallel workers that cannot disturb each other.

``long`` marks what `make test-fast` leaves out (CI runs everything).

A case is long when it launches processes as a user does (``accelerate launch``, ``torchrun``,
notebooks, benchmark scripts: each launch imports torch and transformers' Trainer in every
process, about 10 s on a 2-core CPU) or trains for many steps; measured with ``--durations=0``
on a 2-core CPU machine, every case here took 9 s or more. Kept in one list, so that the fast
loop's contents are visible in one place.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
from pathlib import Path

import pytest

LONG_FILES = {
    "test_cluster.py",
    "test_collectives_exact.py",
    "test_docs.py",
    "test_examples.py",
    "test_launch_errors.py",
    "test_memory_rss.py",
    "test_bounded_memory.py",
    "test_notebooks.py",
    "test_qlora_recipe.py",
    "test_recipe.py",
    "test_restarts.py",
    "test_run.py",
    "test_start_checks.py",
}
"""Files whose every case launches processes or trains at length."""

LONG_CASES = {
    "test_doctor.py": {
        "test_the_peak_make_up_adds_up_and_matches_the_os",  # 16 profiled runs, shared
        "test_each_recommendation_holds_when_applied",
        "test_logits_and_mlp_activations_are_counted_apart",
        "test_doctor_profiles_an_unmodified_trainer_launch",
    },
    "test_faults.py": {
        "test_a_save_killed_midway_leaves_the_last_checkpoint_resumable",
        "test_a_partitioned_stage3_build_resumes_exactly",
        "test_a_full_disk_names_the_folder_and_keeps_the_previous_checkpoint",
        "test_ddp_timeout_bounds_a_stalled_collective_on_cpu",
        "test_the_watchdog_names_where_a_rank_waits_and_who_is_late",
    },
    "test_gpu_check.py": {"test_timing_benchmark_runs_its_systems_on_cpu"},
    "test_infinity.py": {"test_nvme_defaults_keep_the_whole_run_within_the_estimate"},
    "test_integration.py": {
        "test_full_recipe_zero2_with_a_deepspeed_json",
        "test_full_recipe_zero3_with_zeropp_trainer_flags",
        "test_full_recipe_with_tensor_parallel_two_ranks",
        "test_full_recipe_pipeline_stages_resume_exactly_and_consolidate",
        "test_trainer_resume_continues_exactly",
        "test_accelerate_recipe_trains_and_resumes_from_save_state",
        "test_single_process_cpu_yaml_runs_the_lora_recipe_exactly_without_mixz",
        "test_full_recipe_zero_infinity_from_a_model_config",
    },
    "test_lora_reload.py": {
        "test_the_quick_start_prints_no_third_party_notices",  # the shared `make train` run
        "test_the_quick_start_learns_logs_its_collectives_and_exports_the_trained_model",
        "test_adapter_config_names_a_base_that_loads",
        "test_load_for_inference_reproduces_the_trained_logits",
        "test_load_for_inference_finds_the_base_of_a_moved_output_dir",
        "test_load_for_inference_refuses_a_different_base",
        "test_consolidate_a_lora_trainer_checkpoint",
        "test_consolidate_a_full_trainer_checkpoint",
    },
    "test_mixz.py": {"test_mixz_in_bitsandbytes_4bit_formats"},
    "test_partitioned_load.py": {
        "test_from_pretrained_keeps_only_slices_and_trains_as_a_whole_load"
    },
    "test_qlora.py": {
        "test_quantized_weights_move_as_bytes_at_every_stage_and_tier",
        "test_bf16_losses_identical_across_stages",
    },
    "test_sequence.py": {
        "test_trainer_with_sp2_logs_the_one_process_losses",
        "test_trl_sft_with_sp2_logs_the_one_process_losses",
    },
    "test_comm_wire.py": {"test_wire_bytes_agree_with_the_loopback_interface_counters"},
}
"""Long cases in files that are otherwise quick (a fixture's users all listed: it runs once)."""

LONGEST_FILES = [
    "test_restarts.py",
    "test_run.py",
    "test_doctor.py",
    "test_faults.py",
    "test_integration.py",
    "test_zeropp.py",
    "test_examples.py",
    "test_memory_rss.py",
]
"""The files that took over a minute in one process (``--durations=0``, 2-core CPU), longest
first: started first by parallel workers. Order only; every file runs either way."""


CLONE_NEWNET = 0x40000000


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        _own_network()


def _own_network() -> None:
    """Give this parallel worker (``make test`` runs two) a network of its own: a namespace with
    only a loopback interface. The launches a user types bind the launchers' default port
    (29500), and some tests read the loopback interface's byte counters; in a namespace of its
    own, a worker's runs neither collide with nor count the other worker's. ``unshare`` moves the
    calling thread, which is the one that runs the tests: every process and thread it starts
    inherits the namespace."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        raise pytest.UsageError(
            "parallel test workers need a network namespace each, and unshare(CLONE_NEWNET) "
            f"failed ({os.strerror(ctypes.get_errno())}; it needs root): run the tests in one "
            "process with `make test WORKERS=0`"
        )
    try:
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    except FileNotFoundError:
        raise pytest.UsageError(
            "parallel test workers bring up their loopback with `ip` (iproute2), which is not "
            "installed: install it, or run the tests in one process with `make test WORKERS=0`"
        ) from None


@pytest.hookimpl(tryfirst=True)  # before -m / -k deselect anything
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        name = item.path.name
        case = getattr(item, "originalname", item.name)
        if name in LONG_FILES or case in LONG_CASES.get(name, ()):
            item.add_marker(pytest.mark.long)
    # The longest files first, then those with long or slow cases: parallel workers take whole
    # files in this order, and a long file taken last would leave the other worker idle at the
    # end (sorted() keeps the order within each file and among files of the same kind).
    heavy = {i.path for i in items if i.get_closest_marker("long") or i.get_closest_marker("slow")}
    first = {name: i for i, name in enumerate(LONGEST_FILES)}
    items[:] = sorted(
        items, key=lambda i: (first.get(i.path.name, len(first)), i.path not in heavy)
    )
    # A renamed case must not fall out of the list unnoticed (and into the fast loop). Read
    # from the files, so that a run of a few selected cases checks the same.
    here = Path(__file__).parent
    found = list(here.rglob("test_*.py"))
    files = {f.name: f for f in found}
    if len(files) != len(found):  # modules are imported by name
        raise pytest.UsageError("two test files under tests/ have the same name")
    stale = [f for f in LONG_FILES | set(LONG_CASES) | set(LONGEST_FILES) if f not in files]
    for f, cases in LONG_CASES.items():
        if f in files:
            text = files[f].read_text()
            stale += [f"{f}::{c}" for c in sorted(cases) if f"def {c}(" not in text]
    if stale:
        raise pytest.UsageError(f"tests/conftest.py names cases that do not exist: {stale}")
    _check_test_folders_are_on_the_path(here, files.values(), config.getini("pythonpath"))


def _check_test_folders_are_on_the_path(here: Path, files, pythonpath: list) -> None:
    """Test modules import `helpers` and each other by name (so do the ranks `hf_zero.testing`
    forks), which works only for folders in pytest's ``pythonpath`` (pyproject.toml)."""
    configured = {Path(p).resolve() for p in pythonpath}
    missing = sorted(
        {
            str(f.parent.relative_to(here.parent))
            for f in files
            if f.parent.resolve() not in configured
        }
    )
    if missing:
        raise pytest.UsageError(
            f"test folders {missing} are not in [tool.pytest.ini_options] pythonpath "
            "(pyproject.toml); add them there"
        )
