"""Faults, each in its own `accelerate launch` of a recipe (2 CPU ranks), and what survives.

* Every rank SIGKILLed in the middle of a checkpoint save (two moments: the engine's shards
  written but not published; everything but ``trainer_state.json`` written): the newest folder
  ``get_last_checkpoint()`` returns is the previous, complete checkpoint; nothing else looks like
  one; ``--resume_from_checkpoint true`` resumes from it to the losses of an uninterrupted run,
  and the interrupted save's debris is gone.
* A full disk (ENOSPC while writing the engine's shards): the run fails with an error naming the
  folder and the space free; the previous checkpoint is untouched and resumable.
* A stage-3 model built inside ``partitioned_init()`` (``finetune_full.py --model_config``)
  resumes exactly (its empty parameters are filled from the checkpoint's slices).
* Ranks that built different models (a wider hidden size, one more layer) fail at
  `initialize`, every rank with the same error naming the first differing parameter, in
  seconds instead of a crash at the first forward or a hang until the collective timeout.

The faults are injected by ``tests/scripts/faulty_recipe.py`` around the unchanged recipe.
"""

import errno
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import MODEL, ROOT, launch, start
from transformers.trainer_utils import get_last_checkpoint

import hf_zero
from hf_zero.integrations.trainer_checkpoints import STAGING
from hf_zero.testing import run_distributed
from hf_zero.tiny import tiny_llama, tiny_tokenizer

pytestmark = pytest.mark.slow


def _launch(out: Path, *flags: str, recipe: str = "finetune_lora", fault: str | None = None):
    env, script = {}, ROOT / "recipes" / f"{recipe}.py"
    if fault is not None:
        env = dict(HF_ZERO_TEST_FAULT=fault, HF_ZERO_TEST_RECIPE=recipe)
        script = ROOT / "tests/scripts/faulty_recipe.py"
    args = [str(script), "--max_steps", "6", "--learning_rate", "1e-2"]
    args += ["--per_device_train_batch_size", "4", "--save_strategy", "steps", "--save_steps", "2"]
    args += ["--logging_steps", "1", "--report_to", "none", "--disable_tqdm", "true"]
    args += ["--output_dir", str(out), *flags]
    return launch(args, env=env, check=False, new_session=True)


def _losses(out: Path) -> dict[int, float]:
    history = json.loads((out / "log_history.json").read_text())
    return {e["step"]: e["loss"] for e in history if "loss" in e}


def _complete(checkpoint: Path) -> bool:
    names = {p.name for p in checkpoint.iterdir()}
    return {"trainer_state.json", "scheduler.pt", "zero"} <= names


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, float]:
    out = tmp_path_factory.mktemp("faults") / "whole"
    done = _launch(out, "--zero_stage", "3")
    assert done.returncode == 0, done.stderr[-4000:]
    return _losses(out)


@pytest.mark.parametrize("fault", ["kill-engine-save", "kill-before-state"])
def test_a_save_killed_midway_leaves_the_last_checkpoint_resumable(tmp_path, uninterrupted, fault):
    out = tmp_path / "out"
    killed = _launch(out, "--zero_stage", "3", fault=f"{fault}@checkpoint-4")
    assert killed.returncode != 0
    # What transformers' resume-latest picks is the previous checkpoint, complete.
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-2")
    assert _complete(out / "checkpoint-2")
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert (out / STAGING).exists()  # the interrupted save, under a name nothing picks

    resumed = _launch(out, "--zero_stage", "3", "--resume_from_checkpoint", "true")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert not (out / STAGING).exists()
    losses = _losses(out)
    assert [losses[s] for s in (3, 4, 5, 6)] == [uninterrupted[s] for s in (3, 4, 5, 6)]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == [
        "checkpoint-2", "checkpoint-4", "checkpoint-6"
    ]  # fmt: skip


def test_a_full_disk_names_the_folder_and_keeps_the_previous_checkpoint(tmp_path):
    """Stage 3: rank 0 cannot write the streamed model file; rank 1, which only takes part in
    the gathers, fails with it instead of waiting for a collective that never comes."""
    out = tmp_path / "out"
    full = _launch(
        out, "--zero_stage", "3", fault="enospc-model@checkpoint-4", recipe="finetune_full"
    )
    assert full.returncode != 0
    assert "[rank1]" in full.stderr and "SaveFailedError" in full.stderr
    assert f"no space left on the device while saving a checkpoint under {out}" in full.stderr
    assert "MiB free; the last checkpoint took" in full.stderr
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-2")
    assert _complete(out / "checkpoint-2")
    assert not (out / STAGING).exists()  # the partial save's space is given back at once


def test_a_partitioned_stage3_build_resumes_exactly(tmp_path):
    config = tmp_path / "model"
    tiny_llama(0, vocab_size=len(tiny_tokenizer())).config.save_pretrained(config)
    flags = ["--zero_stage", "3", "--model_config", str(config)]
    whole = _launch(tmp_path / "whole", *flags, recipe="finetune_full")
    assert whole.returncode == 0, whole.stderr[-4000:]
    out = tmp_path / "out"
    checkpoint = tmp_path / "whole" / "checkpoint-2"
    resumed = _launch(
        out, *flags, "--resume_from_checkpoint", str(checkpoint), recipe="finetune_full"
    )
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    expected, losses = _losses(tmp_path / "whole"), _losses(out)
    assert [losses[s] for s in (3, 4, 5, 6)] == [expected[s] for s in (3, 4, 5, 6)]


def _built_differently(change: dict) -> str:
    kwargs = {**MODEL, **(change if dist.get_rank() == 1 else {})}
    model = tiny_llama(0, **kwargs)
    try:
        hf_zero.initialize(model, torch.optim.AdamW(model.parameters()), stage=3)
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"hidden_size": 48}, "rank 0 has 'model.embed_tokens.weight' (251, 40) float32"),
        ({"num_hidden_layers": 3}, "rank 1 has 'model.layers.2.self_attn.q_proj.weight'"),
    ],
    ids=["wider", "one-more-layer"],
)
def test_ranks_that_built_different_models_fail_together_naming_the_difference(change, named):
    for message in run_distributed(_built_differently, 2, args=(change,), timeout=60):
        assert "ranks built different models (ranks [1] differ from rank 0)" in message, message
        assert named in message, message


# --- NVMe swap folders ---------------------------------------------------------------------------
def _nvme_engine(nvme: str):
    model = tiny_llama(0, **MODEL)
    return hf_zero.initialize(
        model, torch.optim.AdamW(model.parameters()), stage=3,
        offload_param="nvme", offload_optimizer="nvme", nvme_path=nvme,
    )  # fmt: skip


def _swap_folders(nvme: str) -> list[str]:
    return sorted(str(p.relative_to(nvme)) for p in Path(nvme).glob("hf_zero-swap-*/rank*"))


def test_sigterm_removes_the_swap_folders(tmp_path):
    """The launcher stopped (SIGTERM, as on pre-emption): it stops the ranks with SIGTERM, and
    each rank removes its swap folder before it ends."""
    import signal
    import time

    nvme, marks = tmp_path / "nvme", tmp_path / "marks"
    marks.mkdir()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    script = [str(ROOT / "tests/scripts/nvme_until_signal.py"), str(nvme), str(marks)]
    launcher = start(script, torchrun, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while len(list(marks.glob("ready-*"))) < 2 and time.monotonic() < deadline:
        assert launcher.poll() is None, launcher.communicate()[1][-3000:]
        time.sleep(0.2)
    assert len(_swap_folders(str(nvme))) == 2
    launcher.send_signal(signal.SIGTERM)
    launcher.communicate(timeout=60)
    assert _swap_folders(str(nvme)) == []


def _started_next_to(nvme: str) -> list[str]:
    _nvme_engine(nvme)
    return _swap_folders(nvme)


def test_a_killed_runs_swap_folder_is_removed_at_the_next_start(tmp_path):
    import socket

    nvme = tmp_path / "nvme"
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    dead_pid = int(ended.stdout)
    host = socket.gethostname()
    dead = nvme / "hf_zero-swap-1" / f"rank0.{host}.{dead_pid}"
    alive = nvme / "hf_zero-swap-2" / f"rank0.{host}.{os.getpid()}"  # this test: running
    foreign = nvme / "hf_zero-swap-3" / f"rank0.another-host.{dead_pid}"
    for folder in (dead, alive, foreign):
        folder.mkdir(parents=True)
        (folder / "0.swap").write_bytes(b"x" * 4096)
    during = run_distributed(_started_next_to, 2, args=(str(nvme),))[0]
    assert not dead.exists()
    assert alive.exists() and foreign.exists()  # a live process's, another host's
    assert len([f for f in during if f.startswith("hf_zero-swap-") and ".rank" not in f]) >= 2


def _full_disk(nvme: str) -> str:
    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    os.posix_fallocate = no_space
    try:
        _nvme_engine(nvme)
    except ValueError as error:
        return str(error)
    return "no error"


def test_a_full_nvme_disk_names_the_other_swap_folders(tmp_path):
    nvme = tmp_path / "nvme"
    other = nvme / "hf_zero-swap-2" / f"rank0.elsewhere.{os.getpid()}"
    other.mkdir(parents=True)
    (other / "0.swap").write_bytes(b"x" * 2**20)
    for message in run_distributed(_full_disk, 2, args=(str(nvme),)):
        assert "no space left for NVMe offload" in message, message
        assert f"other swap folders there: {other} (1.0 MiB)" in message, message


def test_ddp_timeout_bounds_a_stalled_collective_on_cpu(tmp_path):
    """One rank stops for 120 s; with --ddp_timeout 5 the other fails its collective within
    seconds (transformers alone leaves CPU groups at 30 minutes), and the run ends with an
    error that says it timed out."""
    out = tmp_path / "out"
    stalled = _launch(
        out, "--zero_stage", "2", "--ddp_timeout", "5", "--save_strategy", "no", fault="stall@120"
    )
    assert stalled.returncode != 0
    assert re.search(r"[Tt]imed out|[Tt]imeout", stalled.stderr), stalled.stderr[-3000:]


def _stalled_peer(seconds: float) -> list[str]:
    import logging
    import time

    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    logging.getLogger("hf_zero.watchdog").addHandler(Collect())
    model = tiny_llama(0, **MODEL)
    engine = hf_zero.initialize(
        model, torch.optim.AdamW(model.parameters()), stage=3, stall_warning_seconds=2
    )
    if dist.get_rank() == 1:
        time.sleep(seconds)  # stopped: not in any collective
    x = torch.randint(0, 200, (2, 16))
    engine.backward(engine(input_ids=x, labels=x).loss)
    engine.step()
    engine.close()
    return seen


def test_the_watchdog_names_where_a_rank_waits_and_who_is_late():
    waiting, stopped = run_distributed(_stalled_peer, 2, args=(8.0,), timeout=120)
    assert stopped == [], stopped  # the rank that was away never waited in a collective
    assert len(waiting) == 1, waiting  # once per stall
    message = waiting[0]
    assert re.search(r"rank 0 has waited \d+ s in .+, called from \S+:\d+ in \w+", message)
    assert "(step 0)" in message and "ranks [1] have not arrived" in message, message


def test_a_watchdog_later_than_the_timeout_warns_at_half_of_it():
    from hf_zero.comm.watchdog import StallWatchdog

    try:
        assert StallWatchdog.start(300, 0, 1, lambda: 0, timeout=60).seconds == 30
        assert StallWatchdog.start(20, 0, 1, lambda: 0, timeout=60).seconds == 20
        assert StallWatchdog.start(0, 0, 1, lambda: 0, timeout=60) is None
    finally:
        StallWatchdog.start(0, 0, 1, lambda: 0)


@pytest.mark.parametrize("saving_rank", [True, False])
def test_the_best_checkpoint_is_recorded_where_it_is_published(tmp_path, saving_rank):
    """With load_best_model_at_end the Trainer records the best checkpoint's folder while it
    saves, i.e. the staged one: every rank must end up with the published path, and so must
    the saved trainer_state.json."""
    from types import SimpleNamespace

    from hf_zero.integrations.run_claim import RunClaim
    from hf_zero.integrations.trainer_checkpoints import save_staged

    class State(SimpleNamespace):
        def save_to_json(self, path):
            Path(path).write_text(json.dumps({"best": self.best_model_checkpoint}))

    trainer = SimpleNamespace(
        state=State(global_step=4, best_model_checkpoint=None),
        args=SimpleNamespace(
            should_save=saving_rank, save_total_limit=None, save_only_model=False, world_size=1
        ),
        accelerator=SimpleNamespace(wait_for_everyone=lambda: None),
    )
    trainer._get_output_dir = lambda trial=None: str(tmp_path)
    Path(tmp_path / "checkpoint-2").mkdir()

    def save():  # what Trainer._save_checkpoint does, in the folder it is given
        folder = Path(trainer._get_output_dir()) / "checkpoint-4"
        (folder / "zero").mkdir(parents=True)
        for part in ("model.safetensors", "scheduler.pt", "rng_state.pth", "zero/COMPLETE"):
            (folder / part).write_bytes(b"x")
        trainer.state.best_model_checkpoint = str(folder)
        trainer.state.save_to_json(folder / "trainer_state.json")

    save_staged(trainer, None, save, RunClaim("owner", "run", None))
    assert trainer.state.best_model_checkpoint == str(tmp_path / "checkpoint-4")
    if not saving_rank:
        return  # the other ranks only keep the path right; the saving rank publishes
    saved = json.loads((tmp_path / "checkpoint-4" / "trainer_state.json").read_text())
    assert saved["best"] == str(tmp_path / "checkpoint-4")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-4"]


def test_a_live_runs_empty_folder_is_left_for_its_ranks(tmp_path):
    """Rank folders are created inside the run folder: one rank's clean-up must not remove the
    run folder another rank of the same (live) launcher is creating its folder in."""
    from hf_zero.storage.swap_folders import RUN_PREFIX, remove_stale

    live = tmp_path / f"{RUN_PREFIX}{os.getpid()}"
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    gone = tmp_path / f"{RUN_PREFIX}{int(ended.stdout)}"
    live.mkdir()
    gone.mkdir()
    remove_stale(tmp_path)
    assert live.exists() and not gone.exists()


_EXIT_PROBE = """
import atexit, sys, threading
import torch.distributed as dist
# Registered before hf_zero's handler, so it runs after it: what the interpreter is left with.
atexit.register(lambda: print("at exit:", dist.is_initialized(),
                              [t.name for t in threading.enumerate() if t.name.startswith("hf_zero")]))
from hf_zero.comm.topology import init_distributed
from hf_zero.comm.watchdog import StallWatchdog
init_distributed()
StallWatchdog.start(300, 0, 1, lambda: 0)
if sys.argv[1] == "fail":
    raise RuntimeError("the script failed")
"""


@pytest.mark.parametrize("ending", ["normal", "fail"])
def test_the_groups_are_destroyed_at_a_normal_exit_and_left_after_a_crash(ending):
    """A script that never calls destroy_process_group() can abort at exit (gloo's threads drop
    tensors while Python finalises); hf_zero destroys the groups first, except after an
    uncaught exception, when a peer may still wait in a collective."""
    done = subprocess.run(
        [sys.executable, "-c", _EXIT_PROBE, ending], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == (0 if ending == "normal" else 1), done.stderr
    expected = "at exit: False []" if ending == "normal" else "at exit: True []"
    assert expected in done.stdout, done.stdout + done.stderr
