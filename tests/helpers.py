"""Shared pieces of the distributed tests: a tiny model, data, and the torch DDP reference.

Everything here runs inside ranks started by ``hf_zero.testing.run_distributed``, except the
launch commands (`clm_command`), which tests and benchmarks run as a user types them.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

import hf_zero
from hf_zero.tiny import tiny_llama

ROOT = Path(__file__).resolve().parents[1]
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch", "--config_file"]
ACCELERATE += [str(ROOT / "configs/accelerate/cpu_2proc.yaml")]
"""``accelerate launch`` with the 2-process CPU config, as the docs type it."""
ACCELERATE_1PROC = [*ACCELERATE[:-1], str(ROOT / "configs/accelerate/cpu_1proc.yaml")]
"""``accelerate launch`` with the 1-process CPU config."""
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
TORCHRUN += ["--max-restarts", "2"]
"""``torchrun`` with 2 processes and up to 2 restarts."""


def _environment(env: dict | None) -> dict:
    """The test run's environment with one thread per process (as the docs' CPU commands set),
    without an ``HF_ZERO_CONFIG`` the test run may have, plus ``env``."""
    base = {k: v for k, v in os.environ.items() if k != "HF_ZERO_CONFIG"}
    return {**base, "OMP_NUM_THREADS": "1", **(env or {})}


def launch(
    args: Sequence[str],
    launcher: Sequence[str] = ACCELERATE,
    env: dict | None = None,
    timeout: int = 300,
    check: bool = True,
    new_session: bool = False,
) -> subprocess.CompletedProcess:
    """Run ``launcher`` + ``args`` from the repository root as a user types it, output captured.

    The environment is `_environment`'s. With ``check`` a failed launch fails the test with the
    ends of its output; ``new_session`` puts it in a process group of its own (a fault that
    kills its group kills only this run)."""
    done = subprocess.run(
        [*launcher, *args],
        env=_environment(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        start_new_session=new_session,
    )
    if check:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return done


def start(
    args: Sequence[str],
    launcher: Sequence[str] = ACCELERATE,
    env: dict | None = None,
    new_session: bool = False,
    stderr: int = subprocess.STDOUT,
) -> subprocess.Popen:
    """`launch` without waiting, for a test that acts on the run while it goes (signals, kills):
    the launcher's process, its output piped as text (``stderr`` into it by default)."""
    return subprocess.Popen(
        [*launcher, *args],
        env=_environment(env),
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        cwd=ROOT,
        start_new_session=new_session,
    )


def clm_command(launcher: list[str], out: Path | str, steps: int, *flags: str) -> list[str]:
    """The unmodified ``recipes/examples/run_clm.py`` under ``-m hf_zero.run`` at stage 3,
    logging every step, with ``launcher`` in front and ``flags`` after."""
    cmd = [*launcher, "-m", "hf_zero.run", str(ROOT / "recipes/examples/run_clm.py")]
    cmd += ["--output_dir", str(out), "--do_train", "--max_steps", str(steps)]
    cmd += ["--per_device_train_batch_size", "4", "--logging_steps", "1", "--report_to", "none"]
    return [*cmd, "--disable_tqdm", "true", "--zero_stage", "3", *flags]


TORCH_EXIT_ABORT = "terminate called without an active exception"


def assert_reference_run_finished(done, finished: bool) -> None:
    """Check the exit of a plain torch run a test compares with (no hf_zero). Such a script, like
    every Trainer script, never calls ``destroy_process_group()``, and torch then sometimes aborts
    at interpreter exit, after the script finished (gloo's threads outlive Python: SIGABRT and
    "terminate called without an active exception"; hf_zero's own runs destroy their groups at
    exit, `hf_zero.comm.teardown`). That abort is accepted only when ``finished`` (the caller's
    evidence that every rank completed, e.g. their reports written); any other failure fails."""
    if done.returncode == 0:
        return
    assert TORCH_EXIT_ABORT in done.stderr and finished, done.stdout[-2000:] + done.stderr[-5000:]


# Dimensions chosen so that flat buckets need padding at world sizes 2 and 4 (prime vocabulary,
# odd sizes), with tied embeddings larger than the test bucket size.
MODEL = dict(
    vocab_size=251,
    hidden_size=40,
    intermediate_size=90,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)
BUCKET = 4000  # elements; the embedding (251 x 40 = 10040) is larger than a bucket
FROZEN = "model.layers.0.input_layernorm.weight"
SEQ, BATCH = 16, 2
DEVICE = torch.device(os.environ.get("HF_ZERO_TEST_DEVICE", "cpu"))
"""Where the ranks compute: CPU everywhere but the GPU lane (scripts/gpu_check.py sets
``HF_ZERO_TEST_DEVICE=cuda``: one rank, NCCL, ``cuda:0``). hf_zero itself takes its device from
the launch environment; the DDP reference and the batches follow this."""


def build_model(seed: int = 0, checkpointing: bool = False, **overrides) -> torch.nn.Module:
    model = tiny_llama(seed, **{**MODEL, **overrides})
    model.get_parameter(FROZEN).requires_grad_(False)
    if checkpointing:
        model.activation_checkpointing_enable()
    return model


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_model(seed: int = 0) -> torch.nn.Module:
    """A PEFT LoRA (r 8) over every linear layer of a tiny Llama with larger weights (0.3)."""
    from peft import LoraConfig, get_peft_model

    base = tiny_llama(seed, initializer_range=0.3)
    return get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS))


def lora_engine(model: torch.nn.Module, lr: float = 3e-3, **cfg):
    """Stage 3 over ``model``'s adapters (AdamW on the trainable parameters only)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    return hf_zero.initialize(model, torch.optim.AdamW(trainable, lr=lr), stage=3, **cfg)


def two_param_groups(model: torch.nn.Module, lr: float = 1e-3) -> list[dict]:
    """Weight decay on matrices, none on vectors, with a different learning rate each."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1, "lr": lr},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "lr": 2 * lr},
    ]


def batch(rank: int, step: int, micro: int, vocab: int = MODEL["vocab_size"]) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randint(0, vocab, (BATCH, SEQ), generator=g).to(DEVICE)


def still_gathered(engine) -> list[str]:
    """The first parameter name of every stage-3 group whose full parameters are held now."""
    return [
        g.names[0]
        for g in engine.groups + engine.frozen_groups
        if g.stage == 3 and g.flat_param is not None
    ]


def named_fp32(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, whole, in fp32 on CPU (gathered first under ZeRO-3)."""
    with hf_zero.gathered_parameters(model.parameters()):
        return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}


def adamw(groups: list[dict]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups)


def train_ddp(
    steps: int,
    gas: int,
    clip: float,
    precision: str = "fp32",
    seed: int = 0,
    make_optimizer=adamw,
    make_scheduler=None,
    norms: list | None = None,
    checkpointing: bool = False,
    process_group=None,
    data_rank: int | None = None,
    model_kwargs: dict | None = None,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The reference: torch DDP, with fp32 master weights kept by hand for 16-bit precisions.

    ``norms`` collects the pre-clip global gradient norm of each step. ``process_group`` and
    ``data_rank`` run DDP on a subgroup (the data-parallel ranks of a TP x DP run).
    """
    rank = dist.get_rank() if data_rank is None else data_rank
    model = build_model(seed, checkpointing, **(model_kwargs or {}))
    master = build_model(seed, **(model_kwargs or {})) if precision != "fp32" else model
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    model.to(DEVICE)
    master.to(DEVICE)
    for p in model.parameters():  # buffers (rotary inv_freq) stay fp32, as in HF bf16 models
        p.data = p.data.to(dtype)
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=process_group)
    opt = make_optimizer(two_param_groups(master))
    scheduler = make_scheduler(opt) if make_scheduler else None
    trainable = [(p, q) for p, q in zip(model.parameters(), master.parameters()) if p.requires_grad]
    losses = []
    for step in range(steps):
        for micro in range(gas):
            ctx = ddp.no_sync() if micro < gas - 1 else contextlib.nullcontext()
            with ctx:
                x = batch(rank, step, micro)
                loss = ddp(input_ids=x, labels=x).loss
                (loss / gas).backward()
            losses.append(loss.item())
        if master is not model:
            for p, q in trainable:
                q.grad = p.grad.float()
        if clip:
            norm = torch.nn.utils.clip_grad_norm_([q for _, q in trainable], clip)
            if norms is not None:
                norms.append(norm.item())
        opt.step()
        if scheduler is not None:
            scheduler.step()
        opt.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        if master is not model:
            with torch.no_grad():
                for p, q in trainable:
                    p.copy_(q)
    return losses, named_fp32(model)


def train_zero(
    steps: int,
    gas: int,
    clip: float,
    stage: int,
    precision: str = "fp32",
    seed: int = 0,
    checkpointing: bool = False,
    make_optimizer=adamw,
    data_rank: int | None = None,
    model_kwargs: dict | None = None,
    **cfg,
):
    """The same run through hf_zero; returns (losses, parameters, engine)."""
    rank = dist.get_rank() if data_rank is None else data_rank
    model = build_model(seed, checkpointing, **(model_kwargs or {}))
    engine = hf_zero.initialize(
        model,
        make_optimizer(two_param_groups(model)),
        stage=stage,
        precision=precision,
        gradient_accumulation_steps=gas,
        gradient_clipping=clip,
        reduce_bucket_size=BUCKET,
        **cfg,
    )
    losses = []
    for step in range(steps):
        for micro in range(gas):
            x = batch(rank, step, micro)
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses, named_fp32(model), engine


def zero_engine(model: torch.nn.Module, **cfg):
    """`hf_zero.initialize` with AdamW on every parameter and the tests' bucket size."""
    return hf_zero.initialize(
        model, torch.optim.AdamW(model.parameters()), reduce_bucket_size=BUCKET, **cfg
    )


def train_step(engine, model: torch.nn.Module, step: int, poison: bool = False) -> bool:
    """One step on this rank's batch; ``poison`` makes rank 1's gradients overflow (inf)."""
    rank = dist.get_rank()
    handle = None
    if poison and rank == 1:  # only one rank overflows
        param = model.get_parameter("model.norm.weight")
        handle = param.register_hook(lambda g: g * float("inf"))
    x = batch(rank, step, 0)
    engine.backward(engine(input_ids=x, labels=x).loss)
    if handle is not None:
        handle.remove()
    return engine.step()


def train_steps(engine, steps: range) -> list[float]:
    """One optimizer step per index in ``steps``, on this rank's ``batch(rank, step, 0)``;
    the losses."""
    losses = []
    for step in steps:
        x = batch(dist.get_rank(), step, 0)
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def train_on_corpus(engine, steps: int, seq_len: int = 64, batch_size: int = 4) -> list[float]:
    """``steps`` optimizer steps on the embedded corpus (disjoint windows per rank); losses."""
    from hf_zero.tiny import token_batches

    batches = token_batches(seq_len, batch_size, dist.get_rank(), dist.get_world_size(), seed=0)
    losses = []
    for _ in range(steps):
        x = next(batches).to(DEVICE)
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-wise relative difference ||a - b|| / ||b||."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def max_param_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(rel_diff(a[k], b[k]) for k in a)


def max_loss_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


QLORA_MODEL = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
QUANTS = {
    "nf4-bf16": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", storage="bfloat16"),
    "fp4-uint8": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4", storage="uint8"),
    "nf4-double": dict(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", storage="bfloat16", double=True
    ),
    "int8": dict(load_in_8bit=True),
}


def load_quantized(path: str, quant: str, dtype=torch.bfloat16, lora: bool = True):
    """``from_pretrained`` with a ``BitsAndBytesConfig`` (as the PEFT docs show) onto this
    test's `DEVICE`, then LoRA on every linear layer. QLoRA test models: sizes multiples of 64
    (bitsandbytes blocks) and of 32 (its CPU repacking)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    spec = dict(QUANTS[quant])
    storage = getattr(torch, spec.pop("storage", "uint8"))
    double = spec.pop("double", False)
    if spec.get("load_in_4bit"):
        spec.update(
            bnb_4bit_compute_dtype=dtype,
            bnb_4bit_quant_storage=storage,
            bnb_4bit_use_double_quant=double,
        )
    config = BitsAndBytesConfig(**spec)
    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=config, dtype=dtype, device_map={"": DEVICE}
    )
    if not lora:
        return model
    torch.manual_seed(1)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    return model.train()  # as the Trainer does (from_pretrained leaves eval mode)


LOOPBACK_TOLERANCE = (0.995, 1.05)
"""lo tx bytes / booked wire bytes: at least the payload (minus rounding), at most +5% of headers
(TCP/IP about 52 B per 64 KiB segment plus ACKs, gloo's message headers: +0.09% to +1.4% seen)."""


def loopback_tx_bytes() -> int | None:
    """The loopback interface's transmitted bytes (``/proc/net/dev``), None where unreadable. In
    the test workers' own network namespaces (tests/conftest.py) only their runs count."""
    try:
        with open("/proc/net/dev") as f:
            for line in f:
                name, _, counters = line.partition(":")
                if name.strip() == "lo":
                    return int(counters.split()[8])
    except OSError:
        return None
    return None
