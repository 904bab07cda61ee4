"""Profiling a real run: memory by object at every phase boundary, time by phase, tokens per
second, per rank and per step (`Profiler`); ``hf-zero doctor`` reads what it writes."""

from hf_zero.profiling.recorder import Profiler, profile_settings

__all__ = ["Profiler", "profile_settings"]
