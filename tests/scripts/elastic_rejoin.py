"""Rejoin a process group in restarted rounds (tests/end_to_end/test_restarts.py):
``elastic_rejoin.py torch|hf_zero`` under ``torchrun --max-restarts N``. Every round forms the
group, then rank 1 fails, until the last round, which ends cleanly. In each restarted round rank 0
comes late, so rank 1 looks its peer up first, where the previous round's rank 0 published its
address. ``torch``: the default group as torch makes it on torchrun's store, where that lookup
finds the dead rank 0 (a connect refused or timed out in about 7 of 10 rounds on a 2-core machine: a
race); ``hf_zero``: as `hf_zero.comm.topology.init_distributed` makes it, on per-round keys."""

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
last = int(os.environ["TORCHELASTIC_MAX_RESTARTS"])
rank = int(os.environ["RANK"])
if attempt > 0 and rank == 0:
    time.sleep(2)
if sys.argv[1] == "hf_zero":
    from hf_zero.comm.topology import init_distributed

    init_distributed("gloo", timeout=10)
else:
    dist.init_process_group("gloo", timeout=timedelta(seconds=10))
value = torch.ones(1)
dist.all_reduce(value)
print(f"rank {rank} joined round {attempt}: {value.item():.0f}", flush=True)
if attempt < last:
    if rank == 1:
        os._exit(1)  # the fault: the launcher restarts both workers
    time.sleep(60)  # until the launcher stops this round
dist.destroy_process_group()
