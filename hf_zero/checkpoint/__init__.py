"""Checkpoint files: the sharded format's names and reader (`format`), publishing a folder
atomically (`publish`), and offline consolidation into Hugging Face weights (`consolidate`).
What an engine writes into a checkpoint lives with the engine (`hf_zero.engine.checkpointing`,
`hf_zero.engine.pipeline_checkpointing`).
"""

from hf_zero.checkpoint.format import is_complete, read_meta
from hf_zero.checkpoint.publish import latest_checkpoint

__all__ = ["is_complete", "latest_checkpoint", "read_meta"]
