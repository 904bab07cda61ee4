"""Pipeline parallelism (issue 19, first part): cutting a Hugging Face causal LM into stages.

`split.py` cuts a decoder-layer model into contiguous stages (balanced by parameter count,
uniform, or an explicit list) and builds the stage module a rank runs; the schedules (GPipe,
1F1B, interleaved 1F1B) come from `torch.distributed.pipelining`, measured exact on gloo/CPU
(tests/test_pipeline.py). Not there yet: the engine API (``pp_size``, ``train_batch``), ZeRO and
AutoTP inside stages, Trainer flags, checkpoints per stage (docs/STATUS.md).
"""

from hf_zero.pipeline.split import CausalLMStage, partition_layers, split_causal_lm

__all__ = ["CausalLMStage", "partition_layers", "split_causal_lm"]
