"""Run a function on N real ranks (gloo, one thread each) and collect what each returns.

Used by hf_zero's own tests and usable in yours::

    from hf_zero.testing import run_distributed

    def body(scale):
        import torch.distributed as dist
        return dist.get_rank() * scale

    assert run_distributed(body, world_size=2, args=(10,)) == [0, 10]

Ranks are forked from a fork server that has already imported torch and transformers' Trainer
(and with it PEFT, bitsandbytes and accelerate: about 5 s of imports a rank would otherwise
repeat), so a group starts in about a second. ``body`` must be importable (a module-level
function). A rank that raises makes the call raise ``AssertionError`` with every failing rank's
traceback; a group that has not finished within ``timeout`` seconds is killed and reported, so a
hang fails the test instead of stalling CI.

The backend is gloo on CPU, or NCCL with ``HF_ZERO_TEST_DEVICE=cuda`` (rank ``r`` on
``cuda:r``; NCCL refuses two ranks on one GPU, so a one-GPU machine runs one rank).
"""

from __future__ import annotations

import datetime
import gc
import io
import multiprocessing as mp
import os
import queue as queue_mod
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch

_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(
    ["hf_zero.testing", "transformers.models.llama.modeling_llama", "transformers.trainer"]
)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int,
    world_size: int,
    port: int,
    node_size: int,
    timeout: float,
    fn: Callable,
    args: Sequence,
    kwargs: dict,
    results: Any,
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank % node_size),
        LOCAL_WORLD_SIZE=str(node_size),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    # What the fork server preloaded stays out of this rank's garbage collections: they would
    # walk (and copy on write) every object of those imports each time they run.
    gc.freeze()
    import torch.distributed as dist

    try:
        backend = "gloo"
        if os.environ.get("HF_ZERO_TEST_DEVICE") == "cuda":
            backend = "nccl"
            torch.cuda.set_device(rank % node_size)
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout)
        )
        value = fn(*args, **kwargs)
        buffer = io.BytesIO()
        torch.save(value, buffer)  # tensors travel as bytes, not shared-memory handles
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable,
    world_size: int,
    args: Sequence = (),
    kwargs: dict | None = None,
    timeout: float = 240.0,
    node_size: int | None = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return each rank's value, by rank.

    ``node_size`` sets ``LOCAL_WORLD_SIZE`` so that several simulated nodes share this machine.
    """
    node_size = node_size or world_size
    results = _CTX.Queue()
    port = free_port()
    procs = [
        _CTX.Process(
            target=_worker,
            args=(rank, world_size, port, node_size, timeout, fn, args, kwargs or {}, results),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    outcomes: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcomes) < world_size:
            try:
                rank, status, payload = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue_mod.Empty:
                break
            outcomes[rank] = (status, payload)
            if status == "error":
                # Peers of a failed rank usually block in a collective: give them a moment to
                # fail on their own, then stop waiting.
                deadline = min(deadline, time.monotonic() + 5.0)
            if time.monotonic() > deadline:
                break
    finally:
        for p in procs:
            p.join(timeout=1.0 if len(outcomes) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join()

    errors = {r: msg for r, (status, msg) in outcomes.items() if status == "error"}
    missing = [r for r in range(world_size) if r not in outcomes]
    if errors or missing:
        lines = [f"{fn.__name__} on {world_size} ranks failed:"]
        lines += [f"--- rank {r} raised:\n{msg}" for r, msg in sorted(errors.items())]
        if missing:
            lines.append(f"--- ranks {missing} did not finish within {timeout:.0f}s (hang?)")
        raise AssertionError("\n".join(lines))
    return [torch.load(io.BytesIO(outcomes[r][1]), weights_only=False) for r in range(world_size)]


DOCTOR_MODEL = {
    "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 6,
    "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 256,
}  # fmt: skip
"""A 19M-parameter Llama whose model states and activations (~600 MiB per rank at stage 0, batch
8 x 128, fp32) stand well above the process's own ~300 MiB: the doctor's test and benchmark."""

LONG_DOCTOR_MODEL = {
    "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4,
    "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 16384,
    "max_position_embeddings": 1024,
}  # fmt: skip
"""A 12M-parameter Llama whose activations at 2 x 1024 tokens are mostly logits (2 x 128 MiB:
the head's output and the loss's log-probabilities) and MLP intermediates: the doctor's case for
tiled logits, tiled MLP and sequence parallelism. Its longest context keeps `tiled_logits: auto`
off (64 MiB of logits per sequence)."""


def profiled_training(
    folder: str,
    stage: int,
    micro: int,
    gas: int,
    checkpointing: bool,
    steps: int,
    lora: bool = False,
    model_config: dict | None = None,
    seq_len: int = 128,
    **settings: Any,
) -> None:
    """One rank (under `run_distributed`): train ``model_config`` (`DOCTOR_MODEL` by default;
    with LoRA adapters on every linear layer of its blocks and the rest frozen, if ``lora``) on
    sequences of ``seq_len`` tokens with ``profile: true`` for a warm-up step and ``steps``
    recorded ones, writing the profile to ``folder``; ``settings`` are more engine settings
    (``offload_optimizer``, ``tp_size``, ``sp_size``...)."""
    import hf_zero
    from hf_zero.tiny import tiny_llama, token_batches

    model = tiny_llama(0, **(model_config or DOCTOR_MODEL))
    if lora:
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(model, LoraConfig(r=8, target_modules=targets))
    if checkpointing:
        model.gradient_checkpointing_enable()
    # The optimizer made inline, as scripts do: a list of the parameters kept here would keep
    # AutoTP's replaced full-size originals alive.
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    engine = hf_zero.initialize(
        model, optimizer, stage=stage, profile=True,
        profile_steps=steps, profile_dir=folder, gradient_accumulation_steps=gas,
        train_micro_batch_size_per_gpu=micro, **settings,
    )  # fmt: skip
    # Tensor- and sequence-parallel ranks share their data-parallel replica's batches.
    topology = engine.topology
    batches = token_batches(seq_len, micro, topology.data_rank, topology.data_size, seed=0)
    for _ in range((steps + 1) * gas):
        x = next(batches)
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
