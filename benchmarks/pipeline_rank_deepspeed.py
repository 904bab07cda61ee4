"""One rank of DeepSpeed's own pipeline engine on a LLaMA model, timed per ``train_batch``.

The reference point for hf_zero's pipeline engine: the same LLaMA shape (`common.llama_shape`),
seed and ranks, cut into a ``deepspeed.pipe.PipelineModule`` (embedding, one layer per decoder
block, final norm + lm_head; ``partition_method="parameters"``) and trained with the engine
``deepspeed.initialize`` returns (1F1B schedule, AdamW, ZeRO stage 1, falling back to 0 if
stage 1 fails; fp32). The optimizer is what DeepSpeed's config ``"AdamW"`` gives: its own
FusedAdam (on CPU a C++ op JIT-built on first use, needs g++), or ``torch.optim.AdamW`` with
``--torch-adam``. Only the hidden states flow between stages: each decoder block rebuilds
its rotary embeddings and causal mask from them. Launched one process per rank by
``common.launch_ranks`` (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK set; ``--result``
appended); every rank writes its JSON result, rank 0's step times are the ones to read.

DeepSpeed is not in the project's venv; install it beside it and put it on PYTHONPATH:

    DS_BUILD_OPS=0 pip install --no-deps --target /work/dslib deepspeed==0.19.8 \\
        einops hjson msgpack ninja py-cpuinfo
    DS_ACCELERATOR=cpu PYTHONPATH=/work/dslib python -c "import sys; sys.path.insert(0, \\
        'benchmarks'); from pathlib import Path; from common import launch_ranks; \\
        print(launch_ranks('benchmarks/pipeline_rank_deepspeed.py', 2, ['--pp', '2', \\
        '--microbatches', '4'], Path('/tmp/dspipe'), 'ds', 600))"

Environment: ``DS_ACCELERATOR=cpu`` (set below if absent; without a GPU DeepSpeed picks CPU
anyway, with a warning). Its CPU accelerator uses oneCCL when ``oneccl_bindings_for_pytorch``
imports and plain torch ``gloo`` otherwise, so nothing Intel-specific is needed. The first run
JIT-builds DeepSpeed's CPU ops (``deepspeed_shm_comm``, ``fused_adam``; g++ and ninja) into
``~/.cache/torch_extensions``: about two minutes on two cores, cached after that.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import llama_shape


class Embed(nn.Module):
    def __init__(self, embed: nn.Embedding):
        super().__init__()
        self.embed = embed

    def forward(self, input_ids):
        return self.embed(input_ids)


class Block(nn.Module):
    """A decoder layer that derives positions, rotary embeddings and the causal mask itself."""

    def __init__(self, layer: nn.Module, rotary: nn.Module, config):
        super().__init__()
        self.layer, self.rotary, self.config = layer, rotary, config

    def forward(self, h):
        from transformers.masking_utils import create_causal_mask

        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        mask = create_causal_mask(
            config=self.config, inputs_embeds=h, attention_mask=None, cache=None, position_ids=pos
        )
        out = self.layer(
            h, attention_mask=mask, position_ids=pos, position_embeddings=self.rotary(h, pos)
        )
        return out[0] if isinstance(out, tuple) else out


class Head(nn.Module):
    def __init__(self, norm: nn.Module, lm_head: nn.Linear):
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, h):
        return self.lm_head(self.norm(h))


def next_token_loss(logits, labels):
    return F.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1)
    )


def build_engine(args, stage: int):
    import deepspeed
    from deepspeed.pipe import PipelineModule
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    config = LlamaConfig(
        **llama_shape(args.hidden, args.layers, args.vocab, args.seq),
        tie_word_embeddings=False,
        attn_implementation="sdpa",
        torch_dtype=torch.float32,
    )
    model = LlamaForCausalLM(config).float()
    inner = model.model
    layers = [Embed(inner.embed_tokens)]
    layers += [Block(layer, inner.rotary_emb, config) for layer in inner.layers]
    layers.append(Head(inner.norm, model.lm_head))
    pipe = PipelineModule(
        layers=layers,
        num_stages=args.pp,
        loss_fn=next_token_loss,
        partition_method="parameters",
    )
    ds_config = {
        "train_micro_batch_size_per_gpu": args.micro_batch_size,
        "gradient_accumulation_steps": args.microbatches,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "torch_adam": args.torch_adam}},
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    params = [p for p in pipe.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=pipe, model_parameters=params, config=ds_config)
    return engine


def batches(args):
    gen = torch.Generator().manual_seed(args.seed + 1)
    while True:
        ids = torch.randint(0, args.vocab, (args.micro_batch_size, args.seq), generator=gen)
        yield ids, ids.clone()


def main(args) -> dict:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    engine, stage, errors = None, None, []
    for stage in (1, 0):
        try:
            engine = build_engine(args, stage)
            break
        except Exception as error:
            errors.append(f"stage {stage}: {type(error).__name__}: {error}")
    if engine is None:
        raise RuntimeError("; ".join(errors))
    data = batches(args)
    times, losses = [], []
    for _ in range(args.warmup + args.steps):
        start = time.perf_counter()
        loss = engine.train_batch(data_iter=data)
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
    result = {
        "status": "ok",
        "rank": torch.distributed.get_rank(),
        "zero_stage": stage,
        "step_times": times[args.warmup :],
        "losses": losses,
        "deepspeed": deepspeed.__version__,
        "optimizer": type(getattr(engine.optimizer, "optimizer", engine.optimizer)).__name__,
    }
    if errors:
        result["fallback"] = errors
    return result


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, kind, default in [
        ("pp", int, 2),
        ("microbatches", int, 4),
        ("micro-batch-size", int, 2),
        ("seq", int, 128),
        ("hidden", int, 256),
        ("layers", int, 4),
        ("vocab", int, 1024),
        ("steps", int, 5),
        ("warmup", int, 2),
        ("lr", float, 1e-3),
        ("seed", int, 0),
    ]:
        p.add_argument(f"--{name}", type=kind, default=default)
    p.add_argument("--torch-adam", action="store_true", help="torch.optim.AdamW, not FusedAdam")
    p.add_argument("--result", type=Path, required=True)
    return p.parse_args()


if __name__ == "__main__":
    args = parse()
    try:
        out, code = main(args), 0
    except BaseException as error:
        traceback.print_exc()
        out, code = {"status": f"error: {type(error).__name__}: {error}"}, 1
    args.result.write_text(json.dumps(out))
    sys.exit(code)
