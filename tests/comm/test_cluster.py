"""Two nodes for real: network namespaces joined by a veth link, launched as users launch them.

Each test builds two namespaces (benchmarks/cluster/simnet.py) and runs ``torchrun --nnodes 2
--node_rank i --rdzv-endpoint <node 0>:port`` in each, 2 ranks per node, gloo over the link.
Skipped, with the reason, where the machine cannot make namespaces (no root, no iproute2).

* stage 3 equals torch DDP (fp32, same seeds, computed in the same run) to 1e-6, with the
  data-parallel traffic crossing the link (two-hop collectives, booked inter-node);
* a checkpoint saved across both nodes resumes bit-exactly;
* when the nodes do not share the checkpoint directory (node 1 gets its own tmpfs there), saving
  fails at once on every rank with a ValueError that names the directory and the ranks.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "benchmarks" / "cluster"))
import simnet  # noqa: E402

OK, WHY = simnet.available()
pytestmark = [pytest.mark.cluster, pytest.mark.skipif(not OK, reason=f"cluster tests: {WHY}")]
JOB = HERE.parent / "scripts" / "cluster_job.py"
PORTS = iter(range(29710, 29800))


@pytest.fixture(scope="module")
def cluster():
    with simnet.SimCluster(rate=None) as c:
        yield c


def _torchrun(cluster, node: int, port: int, args: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "2", "--nproc_per_node", "2", "--node_rank", str(node),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{cluster.addrs[0]}:{port}",
        "--rdzv-id", f"test{port}", "--local-addr", cluster.addrs[node],
        "--rdzv-conf", f"is_host={int(node == 0)}",
        str(JOB), *args,
    ]  # fmt: skip


def _run(cluster, tmp_path: Path, args: list[str], private_dir: Path | None = None) -> list:
    """Run the job on both nodes; the four ranks' results. ``private_dir``: node 1 sees its
    own empty tmpfs there (a filesystem the nodes do not share)."""
    port = next(PORTS)
    cmds = [_torchrun(cluster, i, port, args) for i in (0, 1)]
    if private_dir is not None:
        inner = shlex.join(cmds[1])
        cmds[1] = ["unshare", "-m", "--propagation", "private", "sh", "-c",
                   f"mount -t tmpfs tmpfs {shlex.quote(str(private_dir))} && exec {inner}"]  # fmt: skip
    logs = [tmp_path / f"{args[0]}-node{i}.log" for i in (0, 1)]
    codes = cluster.run_all(cmds, timeout=240, logs=logs)
    out = Path(args[1])
    results = [json.loads(p.read_text()) for p in sorted(out.glob(f"{args[0]}-rank*.json"))]
    assert codes == [0, 0] and len(results) == 4, (codes, [p.read_text()[-3000:] for p in logs])
    return results


def test_stage3_equals_ddp_across_two_nodes(cluster, tmp_path):
    results = _run(cluster, tmp_path, ["parity", str(tmp_path / "out")])
    for r in results:
        assert r["nodes"] == 2
        assert r["loss_diff"] <= 1e-6 and r["param_diff"] <= 1e-6, r
        assert r["inter_node_wire_bytes"] > 0  # the shards did cross between the nodes


def test_checkpoint_saved_on_two_nodes_resumes_exactly(cluster, tmp_path):
    ckpt = tmp_path / "shared" / "ckpt"
    saved = _run(cluster, tmp_path, ["save", str(tmp_path / "out"), str(ckpt)])
    resumed = _run(cluster, tmp_path, ["resume", str(tmp_path / "out"), str(ckpt)])
    for s, r in zip(saved, resumed):
        assert "error" not in s and "error" not in r, (s, r)
        assert r["losses"] == s["losses"]  # bit-exact
    assert not list(ckpt.glob(".probe*"))


def test_checkpoint_directory_the_nodes_do_not_share_fails_early_and_clearly(cluster, tmp_path):
    parent = tmp_path / "local"
    parent.mkdir()
    args = ["save", str(tmp_path / "out"), str(parent / "ckpt")]
    results = _run(cluster, tmp_path, args, private_dir=parent)
    for r in results:
        assert "not one directory every rank shares" in r["error"], r
        assert str(parent / "ckpt") in r["error"] and "ranks [2, 3]" in r["error"], r
    assert not (parent / "ckpt").exists()  # nothing published
