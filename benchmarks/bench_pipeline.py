"""Pipeline schedules measured: bubble, activations in flight, step time (vs DeepSpeed's).

    python benchmarks/bench_pipeline.py [--pp 2] [--microbatches 1,2,4,8] [--layers 8]

For each schedule (GPipe, 1F1B, interleaved 1F1B) and micro-batch count ``m`` it launches
``--pp`` fresh ranks (`pipeline_rank.py`, gloo, one thread each) that train the same LLaMA-shaped
model on the same batches, and reports per run:

* the bubble: the fraction of the schedule's wall time a rank did not compute (forward and
  backward chunks timed inside `torch.distributed.pipelining`), the mean over ranks, next to
  (p-1)/(m+p-1), interleaved (p-1)/(2m+p-1) (`hf_zero.pipeline.schedule_math`);
* activations in flight on the first stage: its peak saved-for-backward bytes, less a part
  that does not grow with m, over one micro-batch's (both fitted from GPipe at m = 1 and 2),
  next to GPipe's m, 1F1B's p and interleaved 1F1B's (2p + p - 1) / 2 (1F1B needs m >= p:
  with fewer micro-batches the engine runs GPipe);
* the step time (``train_batch``: schedule, gradient reduction, optimizer step), the model
  states a rank holds (``memory_report``) and the bytes it sends per step;
* the same for plain data parallelism over the same ranks (the whole model on each, ZeRO-1,
  each rank accumulating its share of the step's micro-batches): what pipeline stages trade
  against;

and, where DeepSpeed imports (``PYTHONPATH`` with deepspeed, see `pipeline_rank_deepspeed.py`),
DeepSpeed's PipelineEngine (1F1B) on the same model, ranks and batches, as the ratio of hf_zero's
1F1B step time to DeepSpeed's. Timings need a quiet machine. Writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from common import launch_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_zero.pipeline.schedule_math import bubble_fraction, in_flight

HERE = Path(__file__).resolve().parent
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


def model_flags(args) -> list[str]:
    return [
        "--pp", str(args.pp), "--micro-batch-size", str(args.micro_batch_size),
        "--seq", str(args.seq), "--hidden", str(args.hidden), "--layers", str(args.layers),
        "--vocab", str(args.vocab), "--steps", str(args.steps), "--warmup", str(args.warmup),
    ]  # fmt: skip


def run_hf_zero(args, schedule: str, m: int, tmp: Path) -> list[dict]:
    flags = [*model_flags(args), "--microbatches", str(m), "--schedule", schedule]
    return launch_ranks(
        str(HERE / "pipeline_rank.py"), args.pp, flags, tmp / f"{schedule}_{m}", schedule, 900
    )


def run_data_parallel(args, m: int, tmp: Path) -> dict:
    flags = [*model_flags(args), "--microbatches", str(m)]
    flags[1] = "1"  # --pp 1: ZeRO-1 over all the ranks
    return launch_ranks(str(HERE / "pipeline_rank.py"), args.pp, flags, tmp / f"dp_{m}", "dp", 900)


def states_mib(rank: dict) -> float:
    memory = rank["memory"]
    kinds = ("params", "grads", "optimizer", "master_weights", "optimizer_states")
    return sum(memory.get(k, 0) for k in kinds) / 2**20


def run_deepspeed(args, m: int, tmp: Path) -> dict:
    try:
        import deepspeed  # noqa: F401
    except ImportError as error:
        return {"status": f"not run: deepspeed does not import ({error})"}
    flags = [
        *model_flags(args),
        "--microbatches",
        str(m),
        "--lr",
        "1e-3",
        "--seed",
        "0",
        "--torch-adam",
    ]  # the same optimizer as hf_zero (torch AdamW)
    try:
        ranks = launch_ranks(
            str(HERE / "pipeline_rank_deepspeed.py"), args.pp, flags, tmp / f"ds_{m}", "ds", 900
        )
    except RuntimeError as error:
        return {"status": f"failed: {error}"}
    return ranks[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--microbatches", default="1,2,4,8")
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=str(HERE / "results" / "bench_pipeline.json"))
    args = p.parse_args()
    counts = [int(x) for x in args.microbatches.split(",")]
    tmp = Path(args.out).with_suffix("")
    tmp.mkdir(parents=True, exist_ok=True)

    if counts[:2] != [1, 2]:
        raise SystemExit("--microbatches must start with 1,2 (one micro-batch's activations)")
    rows = []
    for schedule in SCHEDULES:
        for m in counts:
            ranks = run_hf_zero(args, schedule, m, tmp)
            bubble = statistics.mean(
                1 - statistics.median(r["busy_times"]) / statistics.median(r["schedule_times"])
                for r in ranks
            )
            first = next(r for r in ranks if r["pp_rank"] == 0)
            rows.append({
                "schedule": schedule, "m": m,
                "step_s": statistics.median(first["step_times"]),
                "bubble": bubble, "bubble_formula": bubble_fraction(schedule, args.pp, m),
                "in_flight_formula": in_flight(schedule, args.pp, m),
                "peak_saved_MiB_first_stage": first["peak_saved_bytes"] / 2**20,
                "states_MiB": max(states_mib(r) for r in ranks),
                "sent_MiB": max(r["sent_bytes_per_step"] for r in ranks) / 2**20,
                "final_loss": first["losses"][-1],
            })  # fmt: skip
    # One micro-batch's activations, and what does not grow with m: GPipe at m = 1 and 2.
    one, two = (rows[i]["peak_saved_MiB_first_stage"] for i in (0, 1))
    per_microbatch, fixed = two - one, 2 * one - two
    for row in rows:
        row["in_flight"] = (row["peak_saved_MiB_first_stage"] - fixed) / per_microbatch
    for m in counts[1:]:
        ranks = run_data_parallel(args, m, tmp)
        rows.append({
            "schedule": "data parallel", "m": m,
            "step_s": statistics.median(ranks[0]["step_times"]),
            "peak_saved_MiB_first_stage": ranks[0]["peak_saved_bytes"] / 2**20,
            "states_MiB": max(states_mib(r) for r in ranks),
            "sent_MiB": max(r["sent_bytes_per_step"] for r in ranks) / 2**20,
            "final_loss": ranks[0]["losses"][-1],
        })  # fmt: skip
    deepspeed = {m: run_deepspeed(args, m, tmp) for m in counts}

    print(
        f"pp {args.pp}, LLaMA hidden {args.hidden} x {args.layers} layers, vocab {args.vocab}, "
        f"micro-batch {args.micro_batch_size} x {args.seq}, fp32, ZeRO-1 over 1 replica"
    )
    print(
        f"{'schedule':>17} {'m':>3} {'step s':>7} {'bubble':>7} {'formula':>8} "
        f"{'in flight':>9} {'formula':>8} {'act MiB':>8} {'states MiB':>10} {'sent MiB':>9} "
        f"{'vs DeepSpeed':>13}"
    )
    for row in rows:
        ds = deepspeed[row["m"]]
        ratio = ""
        if row["schedule"] == "1f1b" and ds.get("status") == "ok":
            row["deepspeed_step_s"] = statistics.median(ds["step_times"])
            ratio = f"{row['step_s'] / row['deepspeed_step_s']:.2f}x"
        pipeline = "bubble" in row
        print(
            f"{row['schedule']:>17} {row['m']:>3} {row['step_s']:>7.3f} "
            + (
                f"{row['bubble']:>7.1%} {row['bubble_formula']:>8.1%} {row['in_flight']:>9.2f} "
                f"{row['in_flight_formula']:>8g} "
                if pipeline
                else f"{'':>7} {'':>8} {'':>9} {'':>8} "
            )
            + f"{row['peak_saved_MiB_first_stage']:>8.1f} {row['states_MiB']:>10.1f} "
            f"{row['sent_MiB']:>9.2f} {ratio:>13}"
        )
    for m, ds in deepspeed.items():
        if ds.get("status") != "ok":
            print(f"DeepSpeed m={m}: {ds.get('status')}")
    Path(args.out).write_text(
        json.dumps({"args": vars(args), "rows": rows, "deepspeed": deepspeed}, indent=1)
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
