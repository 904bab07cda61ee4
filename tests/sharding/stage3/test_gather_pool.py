"""Stage 3's gathered buffers kept for reuse (`hf_zero.storage.buffer_pool`) where CPU runs unmap
large frees: a released buffer is handed to the next gather of its size only when nothing else
shares its storage; training is bit-identical to allocating every gather; what the pool keeps
is in `memory_report()` and is fewer buffers than units."""

import torch
import torch.distributed as dist
from helpers import build_model, named_fp32, train_steps, zero_engine

from hf_zero.storage.buffer_pool import BufferPool, NoPool
from hf_zero.testing import run_distributed


def test_a_buffer_is_kept_only_when_nothing_else_shares_its_storage():
    pool = BufferPool(keep_per_size=2)
    shared = pool.take(1024, torch.float32, torch.device("cpu"))
    view = shared[:10]  # e.g. a saved tensor or a hook still holding part of it
    pool.give(shared)
    assert pool.held_bytes() == 0  # reusing it would change what ``view`` reads
    del view
    alone = pool.take(1024, torch.float32, torch.device("cpu"))
    address = alone.data_ptr()
    pool.give(alone)
    del alone
    assert pool.held_bytes() == 4096
    assert pool.take(512, torch.float32, torch.device("cpu")).data_ptr() != address
    assert pool.take(1024, torch.bfloat16, torch.device("cpu")).data_ptr() != address
    again = pool.take(1024, torch.float32, torch.device("cpu"))
    assert again.data_ptr() == address and pool.held_bytes() == 0
    pool.give(again[256:].clone())  # a copy of its own: kept as a buffer of its size
    assert pool.held_bytes() == 768 * 4
    for _ in range(3):  # at most two of a size
        pool.give(torch.empty(768))
    assert pool.held_bytes() == 2 * 768 * 4
    pool.clear()
    assert pool.held_bytes() == 0
    assert NoPool().held_bytes() == 0


def _train(host_memory: str) -> dict:
    model = build_model(0, num_hidden_layers=4)
    engine = zero_engine(model, stage=3, host_memory=host_memory)
    losses = train_steps(engine, range(3))
    unit_bytes = [g.numel * g.dtype.itemsize for g in engine.groups + engine.frozen_groups]
    params = named_fp32(model)  # a whole-model gather: at most two buffers a size stay
    report = engine.memory_report()
    out = {
        "losses": losses,
        "params": params,
        "pool": type(engine.host_memory.pool).__name__,
        "pooled": report["pooled_params"],
        "pool_held": engine.host_memory.pool.held_bytes(),
        "in_total": report["total"] - sum(v for k, v in report.items() if k in DEVICE_KEYS),
        "all_units": sum(unit_bytes),
    }
    engine.close()
    out["after_close"] = engine.memory_report()["pooled_params"]
    dist.barrier()
    return out


DEVICE_KEYS = ("params", "grads", "master_weights", "optimizer_states", "secondary_params",
               "quantized_params")  # fmt: skip


def test_gathers_reuse_released_buffers_bit_identically_under_unmap():
    pooled = run_distributed(_train, 2, args=("unmap",))
    fresh = run_distributed(_train, 2, args=("release",))
    for p, f in zip(pooled, fresh):
        assert p["pool"] == "BufferPool" and f["pool"] == "NoPool"
        assert p["losses"] == f["losses"]
        assert all(torch.equal(p["params"][n], f["params"][n]) for n in f["params"])
        # Kept between steps: some gather buffers, counted in memory_report's total, and
        # fewer than one per unit (units of one size share them).
        assert 0 < p["pooled"] == p["pool_held"] == p["in_total"] < p["all_units"], p
        assert p["after_close"] == 0 and f["pooled"] == 0
