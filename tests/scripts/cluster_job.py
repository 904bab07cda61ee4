"""One job of tests/comm/test_cluster.py, run by ``torchrun --nnodes 2`` in each simulated node.

    cluster_job.py parity OUT          stage 3 and torch DDP, same seeds, same run
    cluster_job.py save OUT CKPT       2 steps, save, 2 more steps
    cluster_job.py resume OUT CKPT     load, the same 2 more steps

Every rank writes ``OUT/<job>-rank<R>.json``; a ValueError (a checkpoint directory the nodes do
not share) is written there instead of raised.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import max_loss_diff, max_param_diff, train_ddp, train_steps, train_zero

STEPS, CLIP = 3, 1.0


def main() -> None:
    job, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    result: dict = {"rank": dist.get_rank()}
    if job == "parity":
        ddp_losses, ddp_params = train_ddp(STEPS, 1, CLIP)
        losses, params, engine = train_zero(STEPS, 1, CLIP, stage=3)
        result |= {
            "nodes": engine.topology.num_nodes,
            "loss_diff": max_loss_diff(losses, ddp_losses),
            "param_diff": max_param_diff(params, ddp_params),
            "inter_node_wire_bytes": engine.comm_stats.wire_bytes(inter_node=True),
        }
    else:
        checkpoint = sys.argv[3]
        _, _, engine = train_zero(2 if job == "save" else 0, 1, CLIP, stage=3)
        try:
            if job == "save":
                engine.save_checkpoint(checkpoint)
            else:
                engine.load_checkpoint(checkpoint)
            result["losses"] = train_steps(engine, range(2, 4))
        except ValueError as err:
            result["error"] = str(err)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{job}-rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
