"""Rejoin a process group in a restarted round (tests/test_restarts.py): ``elastic_rejoin.py
torch|hf_zero`` under ``torchrun --max-restarts 1``. Round 0 forms the group, then rank 1 fails;
in round 1 rank 0 comes late, so rank 1 looks its peer up first, where the previous round's
rank 0 published its address. ``torch``: the default group as torch makes it on torchrun's
store; ``hf_zero``: as `hf_zero.comm.topology.init_distributed` makes it."""

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
rank = int(os.environ["RANK"])
if attempt == 1 and rank == 0:
    time.sleep(2)
if sys.argv[1] == "hf_zero":
    from hf_zero.comm.topology import init_distributed

    init_distributed("gloo", timeout=5)
else:
    dist.init_process_group("gloo", timeout=timedelta(seconds=5))
value = torch.ones(1)
dist.all_reduce(value)
if attempt == 0:
    if rank == 1:
        os._exit(1)  # the fault: the launcher restarts both workers
    time.sleep(60)  # until the launcher stops this round
print(f"rank {rank} joined round {attempt}: {value.item():.0f}", flush=True)
dist.destroy_process_group()
