"""Collectives with byte accounting (and, later, their quantized variants)."""

from hf_zero.comm.collectives import Collectives, CommStats

__all__ = ["Collectives", "CommStats"]
