"""Pipeline parallelism (issue 19, first part): cutting a Hugging Face causal LM into stages.

`split.py` cuts a decoder-layer model into contiguous stages (balanced by parameter count,
uniform, or an explicit list) and builds the stage module a rank runs; the schedules (GPipe,
1F1B, interleaved 1F1B) come from `torch.distributed.pipelining`, measured exact on gloo/CPU
(tests/test_pipeline.py); `engine.py` is the ``train_batch`` engine `initialize` returns for
``pp_size`` > 1. Not there yet: data/tensor parallelism beside the stages, ZeRO inside them,
Trainer flags, checkpoints per stage (docs/STATUS.md).
"""

from hf_zero.pipeline.split import CausalLMStage, partition_layers, split_causal_lm

__all__ = ["CausalLMStage", "partition_layers", "split_causal_lm"]
