"""Build a ZeRO-Infinity engine (stage 3, both tiers on NVMe under argv[1]), say so with a file
``ready-<rank>`` in argv[2], then wait to be stopped (tests/end_to_end/test_faults.py)."""

import os
import sys
import time

import torch

import hf_zero
from hf_zero.tiny import tiny_llama

nvme, marks = sys.argv[1], sys.argv[2]
model = tiny_llama(0, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
hf_zero.initialize(
    model, torch.optim.AdamW(model.parameters()), stage=3,
    offload_param="nvme", offload_optimizer="nvme", nvme_path=nvme,
)  # fmt: skip
with open(os.path.join(marks, f"ready-{os.environ['RANK']}"), "w") as f:
    f.write(str(os.getpid()))
time.sleep(300)
