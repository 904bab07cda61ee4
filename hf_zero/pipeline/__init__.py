"""Pipeline parallelism: a Hugging Face causal LM cut into stages, with data and tensor
parallelism beside them (3D) and ZeRO-1/2 inside each stage.

The ranks are laid out pipeline-outermost by `hf_zero.comm.topology.Topology` (the engines share
it); `split.py` cuts a Llama- or GPT-2-layout model into contiguous stages (balanced by parameter
count, uniform, or an explicit list); `batching.py` joins a Trainer window's micro-batches;
`schedule_math.py` holds the closed forms the estimator and the benchmark use. The engine that
runs `torch.distributed.pipelining`'s schedules on these parts (GPipe, 1F1B, interleaved 1F1B) is
`hf_zero.engine.pipeline_engine.PipelineEngine`, which `initialize` returns for ``pp_size`` > 1;
its stages' ZeRO (stages 0-2 over each stage's replicas) is `hf_zero.sharding`'s flat groups and
`hf_zero.optim`'s sharded optimizer, the same parts `ZeroEngine` runs on.
"""

from hf_zero.pipeline.split import CausalLMStage, partition_layers, split_causal_lm

__all__ = ["CausalLMStage", "partition_layers", "split_causal_lm"]
