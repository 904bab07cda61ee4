"""What pipeline stages send, in `comm_stats` (purpose ``"pp"``) and from outside.

* Booked: every activation a stage sends forward and every input gradient it sends back, as the
  schedule issues them, at their size: per step ``micro-batches x micro-batch x sequence x
  hidden x 4`` bytes from each side of a PP 2 cut (fp32); the tied embedding's gradient sum.
* From outside: the loopback interface's transmitted bytes over a few steady steps equal the
  sum over the ranks of the booked wire bytes (every purpose), within tests/comm/
  test_comm_wire.py's tolerance for headers. A schedule's first step also exchanges its tensor
  shapes (pickled, once per micro-batch shape), which is not booked: the window starts after it.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from helpers import LOOPBACK_TOLERANCE, build_model, loopback_tx_bytes

import hf_zero
from hf_zero.testing import run_distributed

TOLERANCE = LOOPBACK_TOLERANCE
HIDDEN, SEQ, MICRO, PER_MICRO, STEPS = 256, 128, 4, 2, 3


def _window(attempts: int) -> dict:
    model = build_model(0, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=4)
    engine = hf_zero.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3), pp_size=2, pp_microbatches=MICRO
    )
    ids = torch.randint(
        0, 251, (MICRO * PER_MICRO, SEQ), generator=torch.Generator().manual_seed(0)
    )
    batch = {"input_ids": ids, "labels": ids}
    engine.train_batch(batch)  # builds the schedule: shapes exchanged, connections made
    stats, tries = engine.comm_stats, []
    for _ in range(attempts):
        dist.barrier()
        before, booked = loopback_tx_bytes(), stats.wire_bytes()
        sends, tied = stats.wire_bytes("send", "pp"), stats.wire_bytes("all_reduce", "pp")
        dist.barrier()
        for _ in range(STEPS):
            engine.train_batch(batch)
        dist.barrier()
        after = loopback_tx_bytes()
        wire = torch.tensor([stats.wire_bytes() - booked])
        dist.all_reduce(wire)  # the sum over ranks, after the reading
        tries.append((after - before, int(wire)))
        if TOLERANCE[0] <= tries[-1][0] / tries[-1][1] <= TOLERANCE[1]:
            break
        time.sleep(0.5)  # somebody else's traffic: measure again
    return {
        "tries": tries,
        "sends_per_step": (stats.wire_bytes("send", "pp") - sends) // STEPS,
        "tied_per_step": (stats.wire_bytes("all_reduce", "pp") - tied) // STEPS,
        "zero_wire": stats.wire_bytes(purpose="zero"),
    }


def test_stages_book_what_they_send_and_the_loopback_agrees():
    if loopback_tx_bytes() is None:
        pytest.skip("/proc/net/dev has no readable 'lo' counters")
    results = run_distributed(_window, 2, args=(3,))
    activation = MICRO * PER_MICRO * SEQ * HIDDEN * 4  # fp32 hidden states of the whole batch
    embedding = 251 * HIDDEN * 4  # tied: each side sends its copy's gradient once (2 ranks)
    for r in results:
        assert r["sends_per_step"] == activation, r  # forward on stage 0, backward on stage 1
        assert r["tied_per_step"] == embedding, r
    low, high = TOLERANCE
    tries = results[0]["tries"]
    print(
        "loopback tx / booked wire bytes:",
        [f"{lo / wire:.4f} ({lo} / {wire} B)" for lo, wire in tries],
    )
    assert all(lo >= low * wire for lo, wire in tries), tries
    lo, wire = tries[-1]
    assert low * wire <= lo <= high * wire, tries
