"""Stage 3: the coordinator that gathers and releases units around their forward and backward
(`coordinator`), how a model is cut into units (`units`) and entered below them (`entry`), saved
activations that point into gathered buffers (`saved`), whole-weight ``state_dict`` hooks
(`state_dict`), `gathered_parameters` (`gathered`), and models built or loaded directly as shards
(`partitioned_init`, `partitioned_load`).
"""
