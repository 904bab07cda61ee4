"""``hf-zero doctor``: profile a few steps of the user's own launch command (or read a saved
profile), then print what is over budget and the smallest change that fixes it.

    hf-zero doctor --steps 5 -- accelerate launch --config_file cfg.yaml train.py --zero_stage 2
    hf-zero doctor --profile hf_zero_profile --device-memory 40GiB --link-gbps 1 --nodes 2

The command runs unchanged; the doctor only sets ``$HF_ZERO_PROFILE_DIR``,
``$HF_ZERO_PROFILE_STEPS`` and ``$HF_ZERO_PROFILE_EXIT=1`` for it, so hf_zero records the steps
after a warm-up step and then ends the run. Writes ``doctor.json`` (for tools) and
``doctor.png`` (memory by object over one step, and where its time goes) next to the profile.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from hf_zero.doctor.advice import ASSUMED, Budget, format_changes, recommend
from hf_zero.doctor.diagnosis import diagnose, format_report, load_profiles
from hf_zero.profiling.recorder import ENV_DIR, ENV_EXIT, ENV_STEPS

_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_UNITS.update({"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12})


def parse_size(text: str) -> float:
    """``40GiB``, ``512MiB``, ``1.5GB`` or plain bytes."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: give a number with B, KiB, MiB, GiB, TiB (or KB, MB, GB)"
        )
    return float(match.group(1)) * _UNITS[match.group(2).lower()]


def add_parser(sub) -> None:
    p = sub.add_parser(
        "doctor",
        help="profile a run: what is over budget, and the smallest change that fixes it",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--profile", help="read this saved profile folder instead of running")
    p.add_argument("--steps", type=int, default=5, help="steps recorded after a warm-up step")
    p.add_argument("--out", default="hf_zero_doctor", help="folder for the profile and report")
    p.add_argument("--device-memory", type=parse_size, help="memory per rank, e.g. 40GiB")
    p.add_argument("--host-memory", type=parse_size, help="host memory per rank")
    p.add_argument("--link-gbps", type=float, help="inter-node link, Gbit/s")
    p.add_argument("--gpus-per-node", type=int, help="ranks per node (default: the run's)")
    p.add_argument("--nodes", type=int, help="nodes (default: the run's)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- the launch command to profile")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if bool(command) == bool(args.profile):
        print(
            "hf_zero doctor: give either --profile DIR or a launch command after --",
            file=sys.stderr,
        )
        return 2
    folder = Path(args.profile) if args.profile else Path(args.out) / "profile"
    if command:
        code = _profile(command, folder, args.steps)
        if code != 0:
            print(f"hf_zero doctor: the command failed (exit {code})", file=sys.stderr)
            return code
    diagnosis = diagnose(load_profiles(folder))
    budget = Budget(
        args.device_memory, args.host_memory, args.link_gbps, args.gpus_per_node, args.nodes
    )
    changes = recommend(diagnosis, budget)
    print(format_report(diagnosis))
    print()
    print(format_changes(diagnosis, changes, budget))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "diagnosis": diagnosis.as_dict(),
        "budget": budget.__dict__,
        "assumed": ASSUMED,
        "changes": [c.__dict__ for c in changes],
    }
    (out / "doctor.json").write_text(json.dumps(report, indent=1) + "\n")
    from hf_zero.doctor.plot import plot

    picture = plot(diagnosis, out / "doctor.png")
    print(f"\nwrote {out / 'doctor.json'} and {picture}")
    return 0


def _profile(command: list[str], folder: Path, steps: int) -> int:
    """Run the user's command with profiling switched on; its exit code."""
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("profile_rank*.json"):
        old.unlink()  # never read a previous run's profile as this one's
    env = dict(os.environ, **{ENV_DIR: str(folder), ENV_STEPS: str(steps), ENV_EXIT: "1"})
    return subprocess.run(command, env=env).returncode
